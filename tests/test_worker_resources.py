"""What a worker process keeps: the memory a step frees (`launcher.launch.worker_env`), which the
next step's tensors reuse instead of faulting fresh pages in from the kernel; and, in a warm
worker, nothing of a job that has ended (`trainer.mesh.forget_meshes`)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from jobs import mesh_plan, run, startup_hook, store_url, tiny_spec, warm_pool
from parashift.launcher.launch import worker_env
from test_elastic_events import wait_for

# A step's worth of tensors of mixed sizes (MiB), allocated, written and freed three times: the
# fraction of their pages each pass faulted in.
STEPS = """
import json, resource, torch
def faults(): return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
sizes = [8, 3, 24, 1, 40, 8, 8, 2] * 3
passes = []
for _ in range(3):
    before = faults()
    tensors = [torch.ones(mb * 262144) for mb in sizes]
    del tensors
    passes.append((faults() - before) / (sum(sizes) * 256))
print(json.dumps(passes))
"""


def faulted_fractions(env: dict[str, str]) -> list[float]:
    out = subprocess.run([sys.executable, "-c", STEPS], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_a_worker_reuses_the_memory_a_step_freed() -> None:
    kept = faulted_fractions(worker_env("cpu"))
    # glibc's defaults: freed blocks go back to the kernel and are faulted in again.
    returned = faulted_fractions({**worker_env("cpu"), "GLIBC_TUNABLES": ""})
    assert kept[0] > 0.9  # fresh memory: every page faulted in once
    # The same tensors again: most of the freed memory is reused (0.0-0.14 of the pages faulted
    # on the third pass, against 0.45-0.8 with the defaults, in measured runs).
    assert kept[2] < 0.5 * returned[2], (kept, returned)
    assert kept[1] + kept[2] < 0.5 * (returned[1] + returned[2]), (kept, returned)


def test_the_users_own_tunables_win(monkeypatch) -> None:  # noqa: ANN001 - pytest's fixture
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")
    assert worker_env("cpu")["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2"


def threads_of(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("Threads:")).split()[1])


def threads_once_settled(pid: int, at_most: int | None = None, timeout_s: float = 60.0) -> int:
    """The worker's thread count after it has cleaned up its job (it does so after answering):
    as soon as it is `at_most`, else once unchanged for two seconds (or at the deadline)."""
    deadline, last, steady_since = time.monotonic() + timeout_s, threads_of(pid), time.monotonic()
    while time.monotonic() < deadline:
        if at_most is not None and last <= at_most:
            return last
        if at_most is None and time.monotonic() - steady_since >= 2.0:
            return last
        time.sleep(0.2)
        now = threads_of(pid)
        if now != last:
            last, steady_since = now, time.monotonic()
    return last


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="thread counts from Linux /proc")
def test_a_warm_worker_keeps_no_process_group_of_a_job_that_ended(tmp_path: Path) -> None:
    """Each mesh shape is new to the workers: before, DTensor's caches kept every mesh, each
    with its gloo groups' threads (14, 30, 46 threads after three such jobs). After the first
    job, the workers must get back to the count they had then, whatever the machine's load."""
    first: list[int] = []
    for i, mesh in enumerate(({"dp": 2}, {"tp": 2}, {"dp": 2, "tp": 2})):
        spec = tiny_spec(f"threads-{i}", store_url(tmp_path), model={"n_layers": 2, "n_heads": 4}, training={"steps": 2})
        run(spec, mesh_plan(mesh))
        pids = warm_pool().pids(2)
        if not first:
            first = [threads_once_settled(pid) for pid in pids]
        else:
            counts = [threads_once_settled(pid, at_most=limit) for pid, limit in zip(pids, first, strict=True)]
            assert all(c <= f for c, f in zip(counts, first, strict=True)), (i, counts, first)


def test_a_closed_warm_pool_leaves_no_folder() -> None:
    """Its jobs' specs, plans and outputs go with it (a pool per flow run: one folder each)."""
    from parashift.launcher.warm_pool import WarmPool

    pool = WarmPool(0)
    (pool.root / "job0001").mkdir()
    pool.close()
    assert not pool.root.exists()


# A warm worker's boot, then a job of one rank in the same process: the modules the job imported.
FIRST_JOB = """
import json, os, sys
from parashift.launcher import forkserver
from parashift.trainer import worker
forkserver.import_what_jobs_use()
booted = set(sys.modules)
os.environ["PARASHIFT_WARM_WORKER"] = "1"
assert worker.main(sys.argv[1:]) == 0
print(json.dumps(sorted(set(sys.modules) - booted)))
"""


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_a_warm_workers_first_job_imports_nothing_of_torch_or_the_trainer(tmp_path: Path, family: str) -> None:
    """What a job imports on its first run in a process (torch._dynamo, through torch.nn.init's
    first call; the model's family) a spare would otherwise import at the change that takes it
    in, while the other ranks wait: the boot imports it."""
    model = {"family": "llama", "n_kv_heads": 1, "ffn_dim": 64} if family == "llama" else {}
    spec = tiny_spec(f"first-{family}", store_url(tmp_path), model=model, training={"steps": 2, "checkpoint_every": 2})
    (tmp_path / "spec.json").write_text(spec.model_dump_json())
    (tmp_path / "plan.json").write_text(mesh_plan({"dp": 1}).model_dump_json())
    done = subprocess.run([sys.executable, "-c", FIRST_JOB, "--spec", str(tmp_path / "spec.json"),
                           "--plan", str(tmp_path / "plan.json")], env=worker_env("cpu"), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    imported = json.loads(done.stdout.strip().splitlines()[-1])
    assert [m for m in imported if m.split(".")[0] in ("torch", "parashift", "numpy", "fsspec")] == []


# A launcher that starts a job on a warm pool of 2 and waits: the test kills it with SIGKILL.
LAUNCHER = """
import sys, time
from pathlib import Path
from parashift.specs import JobSpec
from parashift.specs.plan import Plan
from parashift.launcher.warm_pool import WarmPool
pool = WarmPool(2)
folder, _ = pool._submit(JobSpec.model_validate_json(Path(sys.argv[1]).read_text()), Plan.data_parallel(2), None, None)
print(folder, flush=True)
time.sleep(600)
"""


def test_warm_workers_end_with_their_killed_launcher(tmp_path: Path) -> None:
    """The agent killed: a warm pool's launcher dies with SIGKILL while its job trains. Its
    workers (forked, in sessions of their own) must not train on unseen, holding the cores a
    rerun needs: every process it started is gone within seconds."""
    import os
    import shutil
    import signal

    from parashift.launcher.processes import descendants, kill_tree, running

    spec = tiny_spec("orphans", store_url(tmp_path), training={"steps": 100_000, "checkpoint_every": 100_000,
                                                                "log_every": 1})
    (tmp_path / "spec.json").write_text(spec.model_dump_json())
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(tmp_path / "spec.json")], stdout=subprocess.PIPE,
                                text=True, start_new_session=True)
    started: list[int] = []
    folder: Path | None = None
    try:
        assert launcher.stdout is not None
        folder = Path(launcher.stdout.readline().strip())
        deadline = time.monotonic() + 120
        while '"event":"step"' not in ((folder / "rank0.out").read_text() if (folder / "rank0.out").exists() else ""):
            assert time.monotonic() < deadline, "the job did not start training"
            time.sleep(0.2)
        started = descendants(launcher.pid)
        assert len(started) >= 2
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 15
        while [pid for pid in started if running(pid)] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert [pid for pid in started if running(pid)] == [], "workers outlived their launcher"
    finally:  # whatever failed: what the launcher started ends with it here
        started = started or (descendants(launcher.pid) if launcher.poll() is None else [])
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        for pid in started:
            if running(pid):
                kill_tree(pid)
        if folder is not None:
            shutil.rmtree(folder.parent, ignore_errors=True)  # the pool's folder: its closer was killed


# Loaded at start-up by the warm workers' forkserver (PYTHONPATH): the first warm worker to
# clean up after a job stays stuck in it, as one did in a gloo group's teardown (its thread
# still sending to the dead rank: the join waits for the collective's timeout).
STUCK_IN_TEARDOWN = """
import os, sys, time
if "--serve" in sys.argv or "parashift.launcher.forkserver" in sys.orig_argv:
    from parashift.trainer import mesh
    _release = mesh.release_leftover_groups
    def release_leftover_groups():
        try:
            os.close(os.open(os.environ["STUCK_MARKER"], os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return _release()
        time.sleep(120)
    mesh.release_leftover_groups = release_leftover_groups
"""


def test_a_warm_worker_stuck_letting_go_of_a_failed_job_leaves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer SIGKILLed, one survivor's clean-up stuck (a process group's teardown): it leaves
    within FAILED_CLEAN_UP_S instead of taking the next job and holding it up (seen: a
    survivor still stuck there 20 s after answering), the launch counts what it held as
    gone, the other survivor's held step stands, and the pool's next job runs on a fresh
    process."""

    from parashift.launcher.segment import failure_reason
    from parashift.launcher.warm_launch import launch_warm
    from parashift.launcher.warm_pool import FAILED_CLEAN_UP_S, WarmPool
    from parashift.specs.plan import Plan
    from test_elastic_events import wait_for
    from test_root_cause import kill_at_step_two, tcp_sockets

    startup_hook(tmp_path, monkeypatch, STUCK_IN_TEARDOWN)
    monkeypatch.setenv("STUCK_MARKER", str(tmp_path / "stuck"))
    pool = WarmPool(3)
    try:
        spec = tiny_spec("stuck-teardown", store_url(tmp_path), training={"steps": 40, "checkpoint_every": 40,
                                                                          "log_every": 1})
        killed: list[int] = []
        pids: list[int] = []
        lines: list[str] = []
        result = launch_warm(pool, spec, Plan.data_parallel(3), on_line=lines.append,
                             on_event=kill_at_step_two(1, killed, pids))
        assert failure_reason(result, lines).startswith("rank 1 killed by signal 9"), lines[-20:]
        assert (tmp_path / "stuck").exists() and len(result.lost_ranks) == 2 and result.lost_ranks[0] == 1, \
            (result.lost_ranks, lines[-20:])
        stuck = result.lost_ranks[1]
        assert any(f"warm worker rank {stuck} (pid {pids[stuck]}) left after the failure" in line
                   for line in lines), lines[-20:]
        assert result.held_step() is not None  # the other survivor's
        wait_for(lambda: tcp_sockets(pids[stuck]) == 0, "the stuck worker to be gone", FAILED_CLEAN_UP_S + 10)
        after = launch_warm(pool, tiny_spec("after-stuck", store_url(tmp_path), training={"steps": 2}),
                            Plan.data_parallel(3))
        assert after.returncode == 0 and after.start is not None and pids[stuck] not in after.start.pids
    finally:
        pool.close()



def test_a_worker_whose_starter_died_before_it_looked_ends() -> None:
    """A process's starter can die before the process watches it (a flow killed while its pool
    spawned): the orphan's parent is then the init process, which a watch of the parent pid
    never sees die (seen: three warm workers orphaned 45 minutes). Named by its starter, the
    dead starter is noticed at once."""
    import os

    from parashift.launcher.processes import starter_env
    from parashift.specs import environ

    named = starter_env()
    assert named == {environ.LAUNCHER_PID: str(os.getpid())}
    watch = "from parashift.launcher.processes import end_with_parent; end_with_parent(0.05); import time; time.sleep(60)"
    gone = subprocess.Popen([sys.executable, "-c", watch], env={**os.environ, environ.LAUNCHER_PID: "1"})
    assert gone.wait(timeout=30) == -9  # its starter (as named) is not its parent: dead already
    kept = subprocess.Popen([sys.executable, "-c", watch], env={**os.environ, **named})
    try:
        with pytest.raises(subprocess.TimeoutExpired):  # its starter is alive: it runs on
            kept.wait(timeout=3)
    finally:
        kept.kill()
        kept.wait()


# torchrun's stand-in: starts a forked client (launcher.forked) whose forkserver has not yet
# listened, prints its pid and, once the client runs a second thread (its watch of this process,
# where it watches from its start) or after 10 s, dies: a launch killed while its workers start.
DYING_TORCHRUN = """
import os, subprocess, sys, time
client = subprocess.Popen([sys.executable, "-m", "parashift.launcher.forked", "parashift.nothing"], env=os.environ,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print(client.pid, flush=True)
deadline = time.monotonic() + 10
while time.monotonic() < deadline:
    try:
        if len(os.listdir(f"/proc/{client.pid}/task")) >= 2:
            break
    except FileNotFoundError:  # it ended already: nothing more to wait for
        break
    time.sleep(0.02)
"""


def test_a_forked_client_whose_launcher_died_while_it_waited_for_its_forkserver_ends(tmp_path: Path) -> None:
    """A forked client waits up to `WAIT_FOR_SERVER_S` for a forkserver still importing; its
    launcher (torchrun) can die in that wait. Watching its parent only once connected, it
    watched the init process it had been handed to, and its worker then trained unseen."""
    import os

    from parashift.launcher.forkserver import PID_ENV, SOCKET_ENV, registry_paths, write_pointer
    from parashift.launcher.processes import running

    importing = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # a server not yet listening
    path = str(tmp_path / "key-token")
    write_pointer(registry_paths(path)[0], path, importing.pid)
    env = {**os.environ, SOCKET_ENV: path, PID_ENV: str(importing.pid)}
    client = int(subprocess.run([sys.executable, "-c", DYING_TORCHRUN], env=env, capture_output=True,
                                text=True, check=True).stdout)
    try:
        wait_for(lambda: not running(client), "the orphaned client to end (not wait on for its forkserver)", 10)
    finally:
        if running(client):
            os.kill(client, 9)
        importing.kill()
        importing.wait()
