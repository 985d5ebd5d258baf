"""Faults while state moves, on real gloo workers: a writer killed in the middle of an
asynchronous save, a reader killed in the middle of a restore. Either way the last committed
checkpoint stays intact and loadable, and the job recovers from it to end bitwise equal to a
run that was never interrupted."""

from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path

import pytest
from jobs import assert_bitwise_equal, checkpoint_store, final_state, kill_tree, tiny_spec
from parashift.launcher import launch
from parashift.launcher.launch import launch_workers
from parashift.specs import JobSpec
from parashift.specs.plan import Plan
from parashift.trainer.events import RestoringEvent, parse

pytestmark = pytest.mark.slow

# Big enough (about 40 MB of state) that writing a checkpoint takes a while to catch.
MODEL = {"n_layers": 4, "d_model": 256, "n_heads": 4, "vocab_size": 512, "seq_len": 16, "dropout": 0.0}
TRAINING = {"global_batch": 4, "micro_batch": 2, "steps": 8, "seed": 3, "checkpoint_every": 2}
DP2 = Plan.data_parallel(2)


def spec_for(name: str, tmp: Path) -> JobSpec:
    return tiny_spec(name, f"file://{tmp}/store", model=MODEL, training=TRAINING)


def run_to_end(spec: JobSpec) -> launch.LaunchResult:
    lines: list[str] = []
    result = launch_workers(spec, DP2, on_line=lines.append)
    assert result.returncode == 0, "\n".join(lines[-40:])
    return result


def start_workers(spec: JobSpec, tmp: Path) -> subprocess.Popen[str]:
    spec_file, plan_file = tmp / "spec.json", tmp / "plan.json"
    spec_file.write_text(spec.model_dump_json())
    plan_file.write_text(DP2.model_dump_json())
    return subprocess.Popen(launch.worker_command(2, spec_file, plan_file, None), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=launch.worker_env("cpu"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory):
    spec = spec_for("reference", tmp_path_factory.mktemp("ref"))
    assert run_to_end(spec).final_step == 8
    return final_state(spec)


def test_writer_killed_during_an_asynchronous_save(reference, tmp_path: Path) -> None:
    spec = spec_for("killed-writer", tmp_path)
    ckpt_root = tmp_path / "store/jobs/killed-writer/ckpt"
    process = start_workers(spec, tmp_path)
    caught: list[str] = []

    def kill_mid_write() -> None:
        """Once a step has committed, kill everything the moment a later rank object is half
        written (its temporary file exists: the rename comes after the last byte)."""
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and process.poll() is None:
            committed = ckpt_root.exists() and any((d / "manifest.json").exists() for d in ckpt_root.iterdir())
            if committed:
                for folder in ckpt_root.iterdir():
                    partial = [f.name for f in folder.iterdir() if f.name.endswith(".parashift-tmp")] if folder.exists() else []
                    if partial and not (folder / "manifest.json").exists():
                        kill_tree(process.pid)
                        caught.append(f"{folder.name}/{partial[0]}")
                        return
            time.sleep(0.001)

    watcher = threading.Thread(target=kill_mid_write)
    watcher.start()
    assert process.stdout is not None
    for _ in process.stdout:
        pass
    watcher.join()
    process.wait()
    assert caught, "no save was caught in the middle of its write"
    assert process.returncode != 0
    store = checkpoint_store(spec)
    committed = store.committed_steps()
    half_written = int(caught[0].split("/")[0])
    assert committed and half_written not in committed
    store.verify(committed[-1])  # the last commit is intact: every chunk checks out

    resumed = run_to_end(spec)
    start = resumed.start
    assert start is not None and start.resumed and start.step == committed[-1] and resumed.final_step == 8
    assert_bitwise_equal(final_state(spec), reference)


def test_reader_killed_during_a_restore(reference, tmp_path: Path) -> None:
    spec = spec_for("killed-reader", tmp_path)
    first = launch_workers(spec, DP2, until_step=4)
    assert first.returncode == 0 and first.final_step == 4
    store = checkpoint_store(spec)
    before = {p: p.stat().st_mtime_ns for p in (tmp_path / "store").rglob("*") if p.is_file()}

    process = start_workers(spec, tmp_path)
    assert process.stdout is not None
    killed = False
    for line in process.stdout:
        if isinstance(parse(line), RestoringEvent):
            kill_tree(process.pid)
            killed = True
            break
    process.wait()
    assert killed and process.returncode != 0
    after = {p: p.stat().st_mtime_ns for p in (tmp_path / "store").rglob("*") if p.is_file()}
    assert after == before  # a restore writes nothing
    assert store.committed_steps() == [2, 4]
    store.verify(4)

    resumed = run_to_end(spec)
    assert resumed.start is not None and resumed.start.step == 4 and resumed.final_step == 8
    assert_bitwise_equal(final_state(spec), reference)


@pytest.fixture
def small_disk(tmp_path: Path):  # noqa: ANN201 - a generator fixture
    """A 2.5 MB tmpfs: room for one checkpoint of the job below, not two (needs root)."""
    folder = tmp_path / "small-disk"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2500k", "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)  # lazily: warm workers may hold a file open


def test_a_full_disk_ends_the_job_with_its_reason_and_keeps_the_last_commit(small_disk: Path) -> None:
    """The save of step 10 finds no space: the job ends at once (a retry would write into the
    same full disk) saying so, with the store and the last committed step, which stays whole."""
    from jobs import warm_pool
    from parashift.trainer.metrics import EXIT_FATAL

    spec = tiny_spec("full-disk", f"file://{small_disk}/store",
                     model={"n_layers": 2, "d_model": 64, "n_heads": 2, "vocab_size": 256, "seq_len": 32},
                     training={"global_batch": 8, "micro_batch": 4, "steps": 20, "checkpoint_every": 5})
    result = warm_pool().run(spec, Plan.data_parallel(2))
    assert result.returncode == EXIT_FATAL, result
    assert result.fatal is not None
    assert result.fatal.message == (f"no space left on device writing checkpoint 10 to file://{small_disk}/store; "
                                    "the last committed step is 5")
    assert checkpoint_store(spec).latest().step == 5
    assert final_state(spec, 5)  # its every object reads back (checksums verified)
