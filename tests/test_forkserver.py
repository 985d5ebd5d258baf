"""Workers forked by a forkserver (launcher.forkserver) behave as `python -m <module>` in an
interpreter of their own would, towards whoever started them: stdio, arguments, environment,
working directory, exit status, signals; a killed client takes its worker with it; what the
server cannot serve exactly starts as its own interpreter; training through it is the same,
bit for bit; and one server is shared by every launcher asking for its environment, until its
code changes or it idles past its linger."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from jobs import assert_bitwise_equal, final_state, mesh_plan, tiny_spec
from parashift.launcher import forkservers, launch, processes
from parashift.launcher.forkservers import Forkserver, find_or_start
from parashift.launcher.processes import parent_of

# A module the forkserver never imported: it reports what it sees, then does what its arguments say.
PROBE = '''
import json, os, signal, sys, time
what = sys.argv[1]
if what == "wait":
    signal.signal(signal.SIGUSR1, lambda *_: (print("usr1", flush=True), sys.exit(5)))
print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "pid": os.getpid(), "parent": os.getppid(),
                  "said": os.environ.get("PARASHIFT_PROBE_SAYS"), "name": __name__, "stdin": sys.stdin.readline().strip()}),
      flush=True)
print("to stderr", file=sys.stderr, flush=True)
if what == "wait":
    time.sleep(60)
sys.exit(int(what))
'''


@pytest.fixture(scope="module")
def probe_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("probe")
    (folder / "probe_module.py").write_text(PROBE)
    env = launch.worker_env("cpu")
    env["PYTHONPATH"] = os.pathsep.join([str(folder), env["PYTHONPATH"]])
    return env


@pytest.fixture(scope="module")
def server(probe_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Forkserver]:
    forkserver = find_or_start(probe_env, tmp_path_factory.mktemp("forkservers"))
    yield forkserver
    forkserver.close()


def start(env: dict[str, str], *args: str, cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "parashift.launcher.forked", "probe_module", *args], cwd=cwd, env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def report(process: subprocess.Popen[str], stdin: str = "hello\n") -> dict[str, object]:
    assert process.stdin is not None and process.stdout is not None
    process.stdin.write(stdin)
    process.stdin.flush()
    return json.loads(process.stdout.readline())


def test_a_forked_worker_sees_and_ends_as_its_own_interpreter_would(server: Forkserver, probe_env: dict[str, str],
                                                                    tmp_path: Path) -> None:
    env = {**probe_env, **server.env(), "PARASHIFT_PROBE_SAYS": "a variable read late"}
    client = start(env, "3", "--flag", cwd=tmp_path)
    seen = report(client)
    _, err = client.communicate(timeout=60)
    assert client.returncode == 3
    assert seen == {"argv": ["3", "--flag"], "cwd": str(tmp_path), "pid": seen["pid"], "parent": server.pid,
                    "said": "a variable read late", "name": "__main__", "stdin": "hello"}
    assert seen["pid"] != client.pid and "to stderr" in err and "refused" not in err

    plain = start({**probe_env, "PARASHIFT_PROBE_SAYS": "a variable read late"}, "3", "--flag", cwd=tmp_path)  # no forkserver: exec
    own = report(plain)
    plain.communicate(timeout=60)
    assert plain.returncode == 3 and own["pid"] == plain.pid
    assert {k: v for k, v in own.items() if k not in ("pid", "parent")} == \
           {k: v for k, v in seen.items() if k not in ("pid", "parent")}


def test_signals_reach_the_worker_and_its_end_is_the_clients(server: Forkserver, probe_env: dict[str, str],
                                                             tmp_path: Path) -> None:
    env = {**probe_env, **server.env()}
    client = start(env, "wait", cwd=tmp_path)
    report(client)
    client.send_signal(signal.SIGUSR1)  # what launcher.launch sends for a stop at a step boundary
    out, _ = client.communicate(timeout=60)
    assert "usr1" in out and client.returncode == 5

    client = start(env, "wait", cwd=tmp_path)
    worker = int(report(client)["pid"])  # type: ignore[call-overload]
    os.kill(worker, signal.SIGKILL)
    client.communicate(timeout=60)
    assert client.returncode == -signal.SIGKILL  # as torchrun would see the worker itself die


def test_a_killed_client_takes_its_worker_with_it(server: Forkserver, probe_env: dict[str, str], tmp_path: Path) -> None:
    client = start({**probe_env, **server.env()}, "wait", cwd=tmp_path)
    worker = int(report(client)["pid"])  # type: ignore[call-overload]
    client.kill()
    client.wait()
    deadline = time.monotonic() + 10
    while Path(f"/proc/{worker}").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not Path(f"/proc/{worker}").exists()


def test_what_the_server_cannot_serve_exactly_starts_as_its_own_interpreter(server: Forkserver, probe_env: dict[str, str],
                                                                           tmp_path: Path) -> None:
    # OMP_NUM_THREADS takes effect when torch loads: a worker asking for another value is not forked
    client = start({**probe_env, **server.env(), "OMP_NUM_THREADS": "2"}, "0", cwd=tmp_path)
    seen = report(client)
    _, err = client.communicate(timeout=60)
    assert client.returncode == 0 and seen["pid"] == client.pid
    assert "refused (start-up environment differs: OMP_NUM_THREADS)" in err

    gone = find_or_start(probe_env, tmp_path)
    gone.close()
    client = start({**probe_env, **gone.env()}, "0", cwd=tmp_path)
    seen = report(client)
    _, err = client.communicate(timeout=60)
    assert client.returncode == 0 and seen["pid"] == client.pid and "is gone" in err


def test_training_on_forked_workers_equals_training_on_fresh_interpreters(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The same job launched through torchrun both ways: every loss, and the final parameters and
    optimizer state, bit for bit; the forked launch's workers are children of the forkserver
    started ahead of it (as a flow run starts it before it profiles and plans, `job_workers`),
    with what a flow adds to its workers' environment: no second server was started."""
    plan = mesh_plan({"dp": 2})
    forked_spec = tiny_spec("forked", f"file://{tmp_path}/a", training={"steps": 6})
    parents: list[int] = []

    def on_event(event: object) -> None:
        if isinstance(event, launch.StartEvent):
            parents.extend(parent_of(pid) or 0 for pid in event.pids)

    launch.start_forkserver("cpu")
    ahead = launch.forkserver_pids()
    flows_env = {"AWS_ACCESS_KEY_ID": "key", "AWS_SECRET_ACCESS_KEY": "secret", "PREFECT_API_URL": "http://127.0.0.1:9/api"}
    forked = launch.launch_workers(forked_spec, plan, on_event=on_event, extra_env=flows_env)
    assert forked.returncode == 0 and set(parents) <= ahead and len(parents) == 2
    assert launch.forkserver_pids() == ahead

    monkeypatch.setenv("PARASHIFT_FORK_WORKERS", "0")
    fresh_spec = tiny_spec("fresh", f"file://{tmp_path}/b", training={"steps": 6})
    fresh = launch.launch_workers(fresh_spec, plan)
    assert fresh.returncode == 0
    assert [(s.step, s.loss) for s in forked.steps] == [(s.step, s.loss) for s in fresh.steps]
    assert_bitwise_equal(final_state(forked_spec), final_state(fresh_spec))


def test_the_client_imports_no_torch() -> None:
    code = "import sys, parashift.launcher.forked; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=launch.worker_env("cpu"))
    assert done.stdout.strip() == "False", done.stderr


def test_a_server_is_found_by_its_start_up_environment(tmp_path: Path) -> None:
    """Launchers share a server where their workers would start alike: variables read late (a
    launch's rank, Prefect's settings) do not matter, one read at start-up does. A folder too
    long for a Unix socket is refused before anything starts."""
    env = launch.worker_env("cpu")
    assert launch.worker_env("cpu")["PYTHONPATH"].split(os.pathsep).count(launch.CODE_ROOT) == 1
    assert forkservers.environment_key(env) == forkservers.environment_key({**env, "RANK": "3", "PREFECT_API_URL": "x"})
    assert forkservers.environment_key(env) != forkservers.environment_key({**env, "OMP_NUM_THREADS": "7"})
    # A node's flow run inherits a worker environment: its own launches ask for the same one.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", env["PYTHONPATH"])
        assert launch.worker_env("cpu")["PYTHONPATH"] == env["PYTHONPATH"]
    with pytest.raises(ValueError, match="set PARASHIFT_FORKSERVER_DIR to a shorter one"):
        find_or_start(env, tmp_path / ("x" * 80))


FIND = "import json, sys; from pathlib import Path; from parashift.launcher import forkservers; " \
       "print(forkservers.find_or_start(json.loads(sys.argv[1]), Path(sys.argv[2])).pid)"


def test_one_server_is_shared_outlives_its_starter_and_makes_way_for_new_code(probe_env: dict[str, str], tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Three launchers asking at once get one server, which outlives the process that started
    it; a stopped server finishes its workers but is never handed out again (a client that chose
    it before starts its worker as an interpreter of its own at once); a server whose
    code changed on disk is stopped and another started in its place; an idle server exits
    after its linger, its pointer with it."""
    askers = [subprocess.Popen([sys.executable, "-c", FIND, json.dumps(probe_env), str(tmp_path)], env=probe_env,
                               stdout=subprocess.PIPE, text=True) for _ in range(3)]
    pids = {int(a.communicate(timeout=60)[0]) for a in askers}
    assert len(pids) == 1
    first = forkservers.find_or_start(probe_env, tmp_path)
    assert {first.pid} == pids and first.running()  # its starter has exited

    deadline = time.monotonic() + 60
    while (reply := forkservers.ask(first.path, {"ping": True, "files": True})) is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    files = reply["files"]
    assert str(Path(launch.__file__).parents[1] / "trainer" / "worker.py") in files and not forkservers.stale(files)
    changed = tmp_path / "module.py"
    changed.write_text("a = 1\n")
    stat = changed.stat()
    changed.write_text("a = 22\n")
    assert forkservers.stale({str(changed): [stat.st_mtime_ns, stat.st_size]})

    # Stopped (a benchmark's cold start) while a worker it forked runs on: never handed out again.
    client = start({**probe_env, **first.env()}, "wait", cwd=tmp_path)
    worker = int(report(client)["pid"])  # type: ignore[call-overload]
    first.stop()
    second = forkservers.find_or_start(probe_env, tmp_path, linger_s=60.0)
    assert second.pid != first.pid and first.running() and processes.running(worker)
    late = start({**probe_env, **first.env()}, "0", cwd=tmp_path)  # a launch that chose it just before
    seen = report(late)
    _, err = late.communicate(timeout=60)
    assert late.returncode == 0 and seen["pid"] == late.pid and "forkserver" in err and "was stopped" in err
    client.kill()
    client.wait()

    monkeypatch.setattr(forkservers, "stale", lambda files: True)
    while forkservers.ask(second.path, {"ping": True}) is None:
        time.sleep(0.05)
    third = forkservers.find_or_start(probe_env, tmp_path, linger_s=1.0)
    assert third.pid != second.pid
    pointer = next(tmp_path.glob("*.json"))
    deadline = time.monotonic() + 60
    while first.running() or second.running() or third.running():  # its worker gone; stale; idle past its linger
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert not processes.running(worker) and not pointer.exists() and not list(tmp_path.glob("*-*"))
