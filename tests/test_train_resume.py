"""Real torchrun workers (2 gloo processes): stop and resume, crash and resume, corrupted
checkpoints, and the same job on S3. Every resumed run must end bitwise equal to a run that
was never interrupted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from jobs import assert_bitwise_equal, checkpoint_store, final_state, kill_tree, tiny_spec
from parashift.launcher.launch import LaunchResult, launch_workers
from parashift.specs.plan import Plan
from parashift.storage import JobPaths, open_store
from parashift.tasks.worker_log import describe
from parashift.trainer.events import CheckpointEvent, FatalEvent, StepEvent, WorkerEvent, parse

pytestmark = pytest.mark.slow

DP2 = Plan.data_parallel(2)


def run(spec, **kwargs: Any) -> LaunchResult:
    lines: list[str] = []
    result = launch_workers(spec, DP2, on_line=lines.append, **kwargs)
    result.lines = lines  # type: ignore[attr-defined]
    assert result.returncode == 0, "\n".join(lines[-40:])
    return result


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory):
    """An uninterrupted 12-step run: the state every other run must reproduce."""
    spec = tiny_spec("reference", f"file://{tmp_path_factory.mktemp('ref')}/store")
    system_tmp = tmp_path_factory.mktemp("system-tmp")  # torchrun's and the workers' temporary directory
    result = run(spec, extra_env={"TMPDIR": str(system_tmp)})
    assert result.final_step == 12 and not result.stopped
    result.left_in_tmp = sorted(p.name for p in system_tmp.iterdir())  # type: ignore[attr-defined]
    return spec, result, final_state(spec)


def test_uninterrupted_run_learns_and_commits(reference) -> None:
    spec, result, _ = reference
    # torchrun's per-run folder went with the launch's own (torch's compile cache, one per user, may stay)
    assert [name for name in result.left_in_tmp if not name.startswith("torchinductor_")] == []
    # nothing of torch's warnings in the run's log (a flattened mesh axis sliced from the root warned on every rank)
    assert [line for line in result.lines if "Warning" in line] == []
    losses = [e.loss for e in result.steps]
    assert len(losses) == 12 and losses[-1] < losses[0] - 0.3
    store = checkpoint_store(spec)
    assert store.committed_steps() == [8, 12]  # keep_checkpoints=2 pruned step 4
    assert any(line.endswith("pruned checkpoint 4 (keep_checkpoints: 2)") for line in result.lines), result.lines
    # A commit's line says the whole checkpoint's size (every rank's object), not rank 0's share
    commits = {e.step: e for e in result.checkpoints}
    for step in (8, 12):
        objects = store.load_manifest(step).objects.values()
        assert len(objects) == 2 and commits[step].bytes_total == sum(o.nbytes for o in objects)
        assert commits[step].ranks == 2
    assert describe(commits[12]).startswith(f"checkpoint step 12 committed: {commits[12].bytes_total / 1e6:,.1f} "
                                            "MB from 2 ranks, written in ")


def test_stop_request_then_resume_is_bitwise_equal(reference, tmp_path: Path) -> None:
    _, _, expected = reference
    spec = tiny_spec("stopped", f"file://{tmp_path}/store")
    store = open_store(spec.storage)

    def stop_after_step_5(event: WorkerEvent) -> None:
        if isinstance(event, StepEvent) and event.step == 5:
            store.put_json(JobPaths(spec.job_id).stop(), {"reason": "test"})

    first = run(spec, on_event=stop_after_step_5)  # tiny_spec: the stop object is checked every step
    assert first.stopped and 5 <= first.final_step < 12
    assert checkpoint_store(spec).latest().step == first.final_step  # stopped at a committed boundary

    store.delete(JobPaths(spec.job_id).stop())
    second = run(spec)
    start = second.start
    assert start is not None and start.resumed and start.step == first.final_step
    assert second.final_step == 12
    assert_bitwise_equal(final_state(spec), expected)


def test_killed_workers_resume_from_last_commit_bitwise_equal(reference, tmp_path: Path) -> None:
    """SIGKILL to the whole worker group right after the first commit: nothing graceful."""
    _, _, expected = reference
    spec = tiny_spec("killed", f"file://{tmp_path}/store", training={"checkpoint_every": 3})
    import subprocess

    from parashift.launcher import launch

    spec_file, plan_file = tmp_path / "spec.json", tmp_path / "plan.json"
    spec_file.write_text(spec.model_dump_json())
    plan_file.write_text(DP2.model_dump_json())
    process = subprocess.Popen(
        launch.worker_command(2, spec_file, plan_file, None),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=launch.worker_env("cpu"),
        start_new_session=True,
    )
    for line in process.stdout:
        if isinstance(parse(line), CheckpointEvent):
            kill_tree(process.pid)
            break
    process.wait()
    assert process.returncode != 0
    assert checkpoint_store(spec).committed_steps() == [3]

    resumed = run(spec)
    assert resumed.start is not None and resumed.start.step == 3 and resumed.final_step == 12
    assert_bitwise_equal(final_state(spec), expected)


def test_corrupted_checkpoint_is_refused_and_the_previous_one_used(reference, tmp_path: Path) -> None:
    _, _, expected = reference
    spec = tiny_spec("corrupt", f"file://{tmp_path}/store")
    run(spec, until_step=8)
    assert checkpoint_store(spec).committed_steps() == [4, 8]
    victim = tmp_path / "store/jobs/corrupt/ckpt/00000008/rank00001.bin"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))

    resumed = run(spec)
    log = "\n".join(resumed.lines)  # type: ignore[attr-defined]
    assert "checksum" in log.lower()
    assert resumed.start is not None and resumed.start.step == 4, "the corrupted step-8 checkpoint must not be loaded"
    assert resumed.final_step == 12
    assert_bitwise_equal(final_state(spec), expected)


def test_another_models_checkpoints_end_the_run_with_one_line(reference, tmp_path: Path) -> None:
    """The same job name on a wider model: no worker trains from scratch over the checkpoints,
    the launch ends with the reason as a `fatal` event and the exit status no retry repeats."""
    import shutil

    from parashift.trainer.metrics import EXIT_FATAL

    spec, _, _ = reference
    shutil.copytree(spec.storage.url.removeprefix("file://"), tmp_path / "store")
    wider = tiny_spec("reference", f"file://{tmp_path}/store", model={"d_model": 64})
    lines: list[str] = []
    result = launch_workers(wider, DP2, on_line=lines.append)
    fatal = result.of(FatalEvent)
    assert result.returncode != 0 and len(fatal) == 1, "\n".join(lines[-30:])
    assert "none of the 2 committed checkpoints of reference" in fatal[0].message
    assert "this job's is float32[64]" in fatal[0].message
    assert f"exitcode  : {EXIT_FATAL}" in "\n".join(lines) and not result.steps
    assert checkpoint_store(spec).committed_steps() == [8, 12]  # the reference's own store is untouched


def test_same_job_on_s3_resumes_bitwise_equal(reference, s3_endpoint: str, s3_bucket: str) -> None:
    _, _, expected = reference
    url = f"s3://{s3_bucket}/parashift"
    spec = tiny_spec("on-s3", url, storage={"url": url, "storage_options": {"endpoint_url": s3_endpoint}})
    first = run(spec, until_step=6)
    assert first.final_step == 6
    assert checkpoint_store(spec).committed_steps() == [4, 6]
    second = run(spec)
    assert second.start is not None and second.start.step == 6 and second.final_step == 12
    assert_bitwise_equal(final_state(spec), expected)


def test_node_local_tier_serves_restores_and_a_bad_copy_falls_back(reference, tmp_path: Path) -> None:
    """With a local tier the node keeps everything its ranks held at the newest step, and a
    restore on the node reads it from there; a corrupted tier copy is caught by its checksums
    and the store is read instead. Either way the run ends bitwise where the uninterrupted one
    did."""
    _, _, expected = reference
    tier = tmp_path / "tier"
    url = f"file://{tmp_path}/store"
    spec = tiny_spec("tiered", url, storage={"url": url, "local_tier": str(tier)})
    run(spec, until_step=6)
    assert {p.parent.name for p in tier.rglob("hold*.bin")} == {"00000004", "00000006"}  # the two newest steps
    assert not list(tier.rglob("rank*.bin")) and not list((tmp_path / "store").rglob("hold*.bin"))
    second = run(spec, until_step=10)
    restoring = second.restoring
    assert restoring is not None and restoring.step == 6 and restoring.bytes_local == restoring.bytes_read > 0

    victim = next(tier.rglob("hold00000.bin"))  # both ranks read the first copy of each box
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    third = run(spec)
    assert "node-local tier unusable" in "\n".join(third.lines)  # type: ignore[attr-defined]
    assert third.start is not None and third.start.step == 10 and third.final_step == 12
    assert_bitwise_equal(final_state(spec), expected)



def test_every_checkpoint_refused_starts_over_exactly_like_a_fresh_run(tmp_path: Path) -> None:
    """Restores read parameters (here DTensors: two ranks on a mesh) in place; when every
    checkpoint is refused after all of it was read (its objects' last bytes corrupted: one
    request each, checked after it landed), `start-over` initialises them again: the run ends
    bitwise where an uninterrupted one did."""
    one = Plan.data_parallel(2)
    fresh = tiny_spec("fresh", f"file://{tmp_path}/fresh")
    assert launch_workers(fresh, one).returncode == 0
    url = f"file://{tmp_path}/store"
    spec = tiny_spec("refused", url)
    assert launch_workers(spec, one, until_step=8).returncode == 0  # checkpoints at 4 and 8
    for obj in (tmp_path / "store").rglob("rank*.bin"):
        data = bytearray(obj.read_bytes())
        data[-10] ^= 0xFF
        obj.write_bytes(bytes(data))
    again = tiny_spec("refused", url, training={"if_checkpoints_unusable": "start-over"})
    lines: list[str] = []
    result = launch_workers(again, one, on_line=lines.append)
    assert result.returncode == 0, "\n".join(lines[-30:])
    assert result.start is not None and result.start.step == 0 and result.final_step == 12
    assert "refused the checkpoint at step 8" in "\n".join(lines)
    assert_bitwise_equal(final_state(again), final_state(fresh))
