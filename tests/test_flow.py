"""The Prefect flow against a real Prefect server, and the README's run command end to end."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from jobs import checkpoint_store, tiny_spec

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]


def read_artifact(key: str):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    async def fetch():
        async with get_client() as client:
            found = await client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))
            return found[0] if found else None

    return asyncio.run(fetch())


def test_train_job_flow_trains_checkpoints_and_publishes(prefect_server: None, tmp_path: Path) -> None:
    from parashift.flows.train import train_job

    spec = tiny_spec("flow-job", f"file://{tmp_path}/store", training={"steps": 8})
    summary = train_job(spec)
    assert summary.steps == 8 and summary.final_loss < summary.first_loss
    assert summary.checkpoint_url.endswith("ckpt/00000008/manifest.json")
    assert checkpoint_store(spec).committed_steps() == [4, 8]
    markdown = read_artifact("flow-job-summary")
    assert markdown is not None and "final loss" in markdown.data
    curve = read_artifact("flow-job-loss-curve")
    assert curve is not None and "loss" in str(curve.data)
    image = read_artifact("flow-job-loss-curve-image")
    assert image is not None and "](data:image/png;base64," in image.data
    assert (tmp_path / "store/jobs/flow-job/reports/loss-curve.png").read_bytes().startswith(b"\x89PNG")
    progress = read_artifact("flow-job-progress")
    assert progress is not None and float(progress.data) == 100.0
    state = train_job(spec, return_state=True)  # already trained: a run that finds nothing to do
    assert state.is_completed()
    assert {"job:flow-job", "model:1x32", "devices:2"} <= set(asyncio.run(tags_of_run(state)))


async def tags_of_run(state: Any) -> list[str]:
    from prefect.client.orchestration import get_client

    async with get_client() as client:
        return (await client.read_flow_run(state.state_details.flow_run_id)).tags


def test_scripted_elasticity_matches_a_static_run(prefect_server: None, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """2 -> 3 -> 1 devices with the same global batch gives the static run's loss at every step:
    uneven shares (3, 3, 2) included, and the data position carries across every change."""
    from parashift.flows import train
    from parashift.flows.train import train_job

    static = train_job(tiny_spec("static", f"file://{tmp_path}/static"))
    spec = tiny_spec("elastic", f"file://{tmp_path}/elastic",
                     elasticity=[{"at_step": 4, "devices": 3, "reason": "scale-up"},
                                 {"at_step": 8, "devices": 1, "reason": "failure"}])

    class LateView:
        """The reshard view as a busy flow makes it: after the segment has committed a step."""

        @staticmethod
        def submit(*args: Any, **kwargs: Any) -> Any:
            deadline = time.monotonic() + 30
            while not checkpoint_store(spec).committed_steps() and time.monotonic() < deadline:
                time.sleep(0.05)
            return view.submit(*args, **kwargs)

    view = train.plan_reshard
    monkeypatch.setattr(train, "plan_reshard", LateView)
    state = train_job(spec, return_state=True)
    elastic = state.result()
    assert [(s.devices, s.start_step, s.final_step) for s in elastic.segments] == [(2, 0, 4), (3, 4, 8), (1, 8, 12)]
    assert {"devices:2", "devices:3", "devices:1"} <= set(asyncio.run(tags_of_run(state)))  # every count it ran on
    static_losses = dict(static.segments[0].losses)
    elastic_losses = dict(loss for seg in elastic.segments for loss in seg.losses)
    assert sorted(elastic_losses) == list(range(1, 13))
    for step, loss in static_losses.items():
        assert elastic_losses[step] == pytest.approx(loss, rel=1e-5), f"step {step}"
    # Before each change the flow published what the new workers would read (and they did); the
    # first segment, a fresh start, read nothing (not the step 4 it committed itself).
    assert read_artifact("elastic-reshard-2") is None
    for devices, step in ((3, 4), (1, 8)):
        reshard = read_artifact(f"elastic-reshard-{devices}")
        assert reshard is not None and f"step {step} onto dp {devices}:" in reshard.description
        rows = reshard.data if isinstance(reshard.data, list) else json.loads(reshard.data)
        assert len(rows) == devices and all(r["bytes_read"] == r["bytes_needed"] > 0 for r in rows)
    # Run again, it starts where the script has it at its committed step (1 device), not on the
    # spec's first count: one segment, no change made.
    again = train_job(spec)
    assert [(s.devices, s.start_step, s.final_step) for s in again.segments] == [(1, 12, 12)]


def test_a_run_that_fell_back_from_a_refused_checkpoint_says_so_in_its_summary(prefect_server: None,
                                                                             tmp_path: Path) -> None:
    """`parashift run` shows progress and a summary, the log holds the rest: a damaged newest
    checkpoint sent the job back one checkpoint (more steps than due) and the terminal said
    nothing of it. The summary counts the run's warnings and shows the first."""
    import logging

    from parashift.flows.train import train_job

    from parashift.commands.run import RunWarnings

    spec = tiny_spec("warned", f"file://{tmp_path}/store", training={"steps": 4, "checkpoint_every": 2})
    train_job(spec)
    manifest = tmp_path / "store/jobs/warned/ckpt/00000004/manifest.json"
    manifest.write_bytes(manifest.read_bytes()[:-10])
    warnings = RunWarnings()
    logging.getLogger().addHandler(warnings)
    try:
        summary = train_job(spec.model_copy(update={"training": spec.training.model_copy(update={"steps": 6})}))
    finally:
        logging.getLogger().removeHandler(warnings)
    assert [(s.start_step, s.final_step) for s in summary.segments] == [(2, 6)]
    line = warnings.line()
    assert line is not None and "the checkpoint at step 4" in line and "in the log; the first: " in line, line


def test_a_stop_asked_before_the_first_launch_is_obeyed_and_one_from_before_the_run_is_not(
        prefect_server: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`parashift stop` a second after `parashift run` (while it profiles and plans) used to be
    deleted by the first launch, and the job trained to its end. Now a stop asked for once the
    run started stops it at its first step boundary; one already there when it started (for a
    run before it) does not."""
    from parashift.flows import train
    from parashift.storage import JobPaths, open_store

    spec = tiny_spec("stop-early", f"file://{tmp_path}/store", training={"steps": 8})
    store, stop_key = open_store(spec.storage), JobPaths(spec.job_id).stop()
    an_hour_ago = datetime.now(UTC) - timedelta(hours=1)
    store.put_json(stop_key, {"reason": "a stop for an earlier run", "requested_at": an_hour_ago.isoformat()})
    profile = train.profile_model

    def profile_then_stop(*args: Any, **kwargs: Any) -> Any:
        done = profile(*args, **kwargs)
        store.put_json(stop_key, {"reason": "parashift stop, while the run plans",
                                  "requested_at": datetime.now(UTC).isoformat()})  # as `parashift stop` writes it
        return done

    monkeypatch.setattr(train, "profile_model", profile_then_stop)
    summary = train.train_job(spec)
    assert summary.segments[-1].stopped and summary.steps < 8, summary.segments
    assert checkpoint_store(spec).committed_steps()[-1] == summary.steps  # stopped with a checkpoint
    monkeypatch.setattr(train, "profile_model", profile)  # the stop is still there: the next run is not stopped by it
    again = train.train_job(spec)
    assert again.steps == 8 and not again.segments[-1].stopped


def test_a_stop_request_says_when_in_either_form_it_is_written() -> None:
    """`parashift stop` writes an ISO time, a pool's preemption Unix seconds; nothing readable: None."""
    from parashift.tasks.launch import _requested_at

    when = datetime(2026, 12, 6, 14, 0, tzinfo=UTC)
    assert _requested_at({"requested_at": when.isoformat()}) == when
    assert _requested_at({"requested_at": when.timestamp()}) == when
    assert _requested_at({"requested_at": "2026-12-06T14:00:00"}) == when  # no zone: UTC
    assert _requested_at({"requested_at": "soon"}) is None and _requested_at({"requested_at": True}) is None
    assert _requested_at({}) is None and _requested_at([1]) is None


def test_readme_run_command_trains_the_default_spec_though_the_api_starts_slower_than_prefects_default(
        tmp_path: Path) -> None:
    """`parashift run specs/default.yaml` on the embedded defaults (ephemeral API on a fresh
    database, file://, 2 CPU workers), in a user's environment (no startup timeout set), on a
    busy machine: there Prefect's ephemeral API took over its default 20 s to answer, and the
    first `parashift run` failed "Timed out while attempting to connect". Simulated: the API
    server's process (the one Prefect marks PREFECT__SERVER_EPHEMERAL) sleeps 21 s before it
    starts (past the 20 s by itself, on any machine). The run trains, no timeout, no traceback."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(
        "import os, time\nif os.environ.get('PREFECT__SERVER_EPHEMERAL') == '1':\n    time.sleep(21)\n")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PREFECT_API") and k != "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"}
    env["PREFECT_HOME"] = str(tmp_path / "prefect-home")
    env["PYTHONPATH"] = os.pathsep.join([str(hooks), *filter(None, [env.get("PYTHONPATH")])])
    parashift = Path(sys.executable).with_name("parashift")
    done = subprocess.run(
        [str(parashift), "run", str(REPO / "specs/default.yaml")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "Timed out" not in output and "Traceback" not in output, output[-3000:]
    assert "tiny-gpt trained to step 60" in output
    first, last = map(float, re.search(r"loss\s+([\d.]+) -> ([\d.]+)", output).groups())
    assert last < first - 1.0
    committed = sorted(p.parent.name for p in (tmp_path / "parashift-store/jobs/tiny-gpt/ckpt").glob("*/manifest.json"))
    assert committed == ["00000040", "00000060"]
    # The embedded API is the one the command started at its first step, not one Prefect starts at the flow's first call.
    log = next((tmp_path / ".parashift/logs").glob("tiny-gpt-*.log")).read_text()
    assert "Beginning flow run" in log and "Starting temporary server" not in log, log[:3000]


def test_s3_credentials_come_from_a_prefect_secret_block(
    prefect_server: None, s3_endpoint: str, s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No AWS variables in the environment: the flow and its workers get them from the block."""
    from parashift.flows.train import train_job
    from prefect.blocks.system import Secret

    creds = {key: os.environ[key] for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")}
    Secret(value=creds).save("parashift-test-s3", overwrite=True)
    for key in creds:
        monkeypatch.delenv(key)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    url = f"s3://{s3_bucket}/jobs-root"
    spec = tiny_spec(
        "s3-secret",
        url,
        storage={"url": url, "storage_options": {"endpoint_url": s3_endpoint}, "credentials_block": "parashift-test-s3"},
        training={"steps": 4},
    )
    summary = train_job(spec)
    assert summary.checkpoint_url == f"{url}/jobs/s3-secret/ckpt/00000004/manifest.json"


def _stat(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def with_start_times(pids: set[int]) -> dict[int, str]:
    """Each process of `pids` with its start time (clock ticks since boot): with it, a pid the
    kernel gave to another process (or thread) since is not taken for the one seen. The suite
    starts threads by the thousand (pid_max 32768 here): a seen pid can name another by the end."""
    return {pid: fields[19] for pid in pids if (fields := _stat(pid)) is not None and len(fields) > 19}


def _alive(pid: int, since: str | None = None) -> bool:
    """The process `pid` runs (not a zombie), and is the one that started at `since` if given."""
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z" and (since is None or fields[19] == since)


def _described(seen: dict[int, str]) -> list[str]:
    """Each live process of `seen`: its pid, state, parent and command line (what a failure
    needs to say which process outlived the run)."""
    out = []
    for pid, since in sorted(seen.items()):
        fields = _stat(pid)
        if fields is None or not _alive(pid, since):
            continue
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        out.append(f"{pid} state {fields[0]} parent {fields[1]}: {command[:300]}")
    return out


@pytest.mark.parametrize("stop", ["SIGTERM", "SIGINT"])
def test_sigterm_or_ctrl_c_stops_parashift_run_at_a_committed_step_and_leaves_nothing_running(
        stop: str, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, prefect_home: Callable[[Path], Path],
        request: pytest.FixtureRequest) -> None:
    """A process manager's `kill PID` on `parashift run` (embedded Prefect API), or a terminal's
    Ctrl-C (SIGINT to the whole foreground process group): the workers stop at a step boundary,
    the step is committed, and no process it started outlives it (workers, torchrun, the
    temporary Prefect server), but for the machine's forkserver, which lingers for the next run
    (it is this test's own, and stopped at its end). Until 2026-12-06 a Ctrl-C also stopped
    Prefect's own embedded server, in the run's group, and the run hung retrying it."""
    import signal
    import time

    from jobs import descendants, kill_tree
    from parashift.launcher.forkservers import stop_all

    spec = tmp_path / "long.yaml"
    spec.write_text(
        "name: long-job\n"
        "model: {n_layers: 1, d_model: 32, n_heads: 2, seq_len: 32}\n"
        "data: {max_bytes: 100000}\n"
        "training: {global_batch: 4, micro_batch: 2, steps: 100000, checkpoint_every: 20}\n"
        f"storage: {{url: 'file://{tmp_path}/store'}}\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env["PREFECT_HOME"] = str(prefect_home(tmp_path / "prefect-home"))
    forkservers = tmp_path_factory.mktemp("fs")  # short: a Unix socket's path is at most 107 bytes
    env["PARASHIFT_FORKSERVER_DIR"] = str(forkservers)
    parashift = str(Path(sys.executable).with_name("parashift"))
    running = subprocess.Popen([parashift, "run", str(spec)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    request.addfinalizer(lambda: (running.poll() is None and kill_tree(running.pid), stop_all(forkservers)))
    ckpt = tmp_path / "store/jobs/long-job/ckpt"
    deadline = time.monotonic() + 300
    seen: dict[int, str] = {}  # pid: its start time

    def look() -> None:  # what the run started: below it, and forked for it by its forkserver
        seen.update(with_start_times(descendants(running.pid)))
        for pointer in forkservers.glob("*.json"):
            seen.update(with_start_times(descendants(json.loads(pointer.read_text())["pid"])))

    while not list(ckpt.glob("*/manifest.json")):
        assert running.poll() is None and time.monotonic() < deadline, running.stdout.read()[-3000:]
        look()
        time.sleep(0.5)
    look()
    assert len(seen) >= 3, "torchrun and two workers at least"
    if stop == "SIGTERM":
        running.send_signal(signal.SIGTERM)
    else:
        os.killpg(running.pid, signal.SIGINT)  # its own session's group: the terminal's foreground group here
    output, _ = running.communicate(timeout=120)
    assert running.returncode == 0, output[-3000:]
    assert stop in output and "stopped" in output and "run again to resume" in output, output[-3000:]
    log = next((tmp_path / ".parashift/logs").glob("long-job-*.log")).read_text()
    assert "Traceback" not in log, log[-5000:]  # torchrun does not hear the Ctrl-C: it ends as the workers stop
    stopped_at = int(re.search(r"long-job at step (\d+)", output).group(1))
    assert 0 < stopped_at < 100000
    assert (ckpt / f"{stopped_at:08d}/manifest.json").exists(), "the stop step must be committed"
    # The forkserver lingers by design; a look during its start, before it left the run's tree,
    # saw it among the run's descendants (a clean clone's failure: it outlived the run, parent 1).
    for pointer in forkservers.glob("*.json"):
        seen.pop(json.loads(pointer.read_text())["pid"], None)
    deadline = time.monotonic() + 30
    while any(_alive(pid, since) for pid, since in seen.items()) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _described(seen), f"processes outlived parashift run: {_described(seen)}"


def test_a_killed_parashift_run_does_not_block_the_next(tmp_path: Path, prefect_home: Callable[[Path], Path]) -> None:
    """`kill -9` of `parashift run`'s pid alone: what it started ends with it (its embedded
    Prefect API by a parent-death signal, until 2026-12-06 left running; torchrun and the
    workers with their launcher), nothing is left to release its storage lease or its Prefect
    slot, yet the next run resumes from the last commit within 90 s (its lease's holder is seen
    gone from this machine; the slot it held in the embedded API's database is freed by the run
    that holds the lease)."""
    import signal
    import time

    from jobs import descendants, kill_tree

    spec = tmp_path / "job.yaml"
    body = ("name: killed-job\nmodel: {{n_layers: 1, d_model: 32, n_heads: 2, seq_len: 32}}\ndata: {{max_bytes: 100000}}\n"
            "training: {{global_batch: 4, micro_batch: 2, steps: {steps}, checkpoint_every: 10}}\n"
            f"storage: {{{{url: 'file://{tmp_path}/store'}}}}\n")
    spec.write_text(body.format(steps=100000))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env["PREFECT_HOME"] = str(prefect_home(tmp_path / "prefect-home"))  # one embedded API database for both runs
    parashift = str(Path(sys.executable).with_name("parashift"))
    running = subprocess.Popen([parashift, "run", str(spec)], cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)
    ckpt = tmp_path / "store/jobs/killed-job/ckpt"
    deadline = time.monotonic() + 300
    while not list(ckpt.glob("*/manifest.json")):
        assert running.poll() is None and time.monotonic() < deadline
        time.sleep(0.5)
    started_by_it = with_start_times(descendants(running.pid))  # its embedded API and torchrun's forked client at least
    assert len(started_by_it) >= 2, started_by_it
    os.kill(running.pid, signal.SIGKILL)
    running.wait()
    deadline = time.monotonic() + 15
    while [pid for pid, since in started_by_it.items() if _alive(pid, since)] and time.monotonic() < deadline:
        time.sleep(0.2)
    outlived = [pid for pid, since in started_by_it.items() if _alive(pid, since)]
    for pid in outlived:  # not left behind by the test when it fails
        kill_tree(pid)
    assert not outlived, "processes outlived a killed parashift run"
    committed = max(int(p.parent.name) for p in ckpt.glob("*/manifest.json"))
    spec.write_text(body.format(steps=committed + 4))
    started = time.monotonic()
    again = subprocess.run([parashift, "run", str(spec)], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=300)
    output = again.stdout + again.stderr
    assert again.returncode == 0, output[-3000:]
    assert f"trained to step {committed + 4} (4 steps this run)" in output
    # 90 s on a quiet machine (most of it the embedded API's start); a loaded one is slower.
    assert time.monotonic() - started < 150, f"the next run took {time.monotonic() - started:.0f} s"
    assert not descendants(running.pid)


def test_a_stopped_job_ends_in_a_state_named_stopped(prefect_server: None, tmp_path: Path) -> None:
    from parashift.flows.train import train_job
    from parashift.launcher import interrupts as launch

    spec = tiny_spec("stop-state", f"file://{tmp_path}/store", training={"steps": 200})
    launch.interrupt("a test asked")  # before the launch: the workers stop at their first boundary
    try:
        state = train_job(spec, return_state=True)
    finally:
        launch.reset_interrupt()
    assert state.is_completed() and state.name == "Stopped", state
    summary = state.result()
    assert 0 < summary.steps < 200
    assert state.message == f"stop-state stopped at step {summary.steps} of 200 (asked to stop); run it again to resume"


def test_parashift_stop_asks_the_job_to_stop(tmp_path: Path) -> None:
    """`parashift stop SPEC` leaves the stop object the workers poll (honoured in test_train_resume)."""
    from parashift.storage import JobPaths, ObjectStore
    from typer.testing import CliRunner

    from parashift.cli import app

    spec = tmp_path / "job.yaml"
    spec.write_text(f"name: some-job\nstorage: {{url: 'file://{tmp_path}/store'}}\n")
    done = CliRunner().invoke(app, ["stop", str(spec)])
    assert done.exit_code == 0, done.output
    assert ObjectStore(f"file://{tmp_path}/store").exists(JobPaths("some-job").stop())
    assert "no run of some-job holds its lease now" in done.output  # nothing runs: said so


def test_auto_strategy_measures_on_real_workers_and_plans(prefect_server: None, tmp_path: Path) -> None:
    """strategy auto: GEMM rates timed here, collectives timed on the job's own 2 workers, the
    profile cached in storage, the planner's plan published as an artifact and executed."""
    from parashift.flows.train import train_job
    from parashift.planner.profile import ModelProfile
    from parashift.storage import JobPaths, open_store
    from parashift.tasks.profile import profile_key

    spec = tiny_spec("auto-plan", f"file://{tmp_path}/store", training={"steps": 4}, parallelism={"strategy": "auto"})
    summary = train_job(spec)
    assert summary.steps == 4
    store = open_store(spec.storage)
    # the job's count's profile (the count a failure would leave, 1, is profiled ahead while it trains)
    profile = ModelProfile.model_validate(store.get_json(JobPaths("auto-plan").profile(profile_key(spec))))
    assert profile.comm.measured and profile.device.measured
    assert profile.comm.intra.bandwidth_Bps > 0 and profile.device.matmul_flops > 1e8
    artifact = read_artifact("auto-plan-plan-2")
    assert artifact is not None and "baselines" in artifact.description
