"""The metrics component writes TensorBoard event files into the job's storage: each segment of
an elastic run its own file, read back with TensorBoard's own reader as one curve per tag."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from jobs import run, tiny_spec
from parashift.planner.profile import measure_device
from parashift.specs.plan import Plan
from parashift.storage import ObjectStore, job_store

pytestmark = pytest.mark.slow


def scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] over every event file in `folder`, by tensorboard's EventAccumulator."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(folder.glob("events.out.tfevents*")):
        events = EventAccumulator(str(path))
        events.Reload()
        for tag in events.Tags()["scalars"]:
            out.setdefault(tag, []).extend((e.step, e.value) for e in events.Scalars(tag))
    return out


def test_an_elastic_run_writes_every_step_once_with_mfu(tmp_path: Path) -> None:
    """2 -> 3 -> 1 devices, four steps each, every step logged: the store's metrics folder holds
    one event file per segment; loss, grad norm, lr, tokens/s, TFLOP/s, MFU and memory are there
    for steps 1..12, once each, MFU in (0, 1] against this machine's measured GEMM rate."""
    spec = tiny_spec("board", f"file://{tmp_path}/store", training={"steps": 12, "log_every": 1})
    peak = measure_device("cpu").matmul_flops
    for devices, until in ((2, 4), (3, 8), (1, 12)):
        run(spec, Plan.data_parallel(devices, device_peak_flops=peak), until_step=until)
    folder = Path(job_store(spec).store.url_for("jobs/board/metrics").removeprefix("file://"))
    files = sorted(p.name for p in folder.iterdir())
    assert len(files) == 3 and all(name.startswith("events.out.tfevents") for name in files), files
    found = scalars(folder)
    for tag in ("loss", "grad_norm", "lr", "tokens_per_s", "tflops", "mfu", "memory_gib", "data_wait_s"):
        assert sorted(step for step, _ in found[tag]) == list(range(1, 13)), tag
    assert all(0 < value <= 1 for _, value in found["mfu"])
    assert all(value > 0 for _, value in found["grad_norm"])


def test_steps_trained_again_after_a_fallback_show_once_in_tensorboard(tmp_path: Path) -> None:
    """The newest checkpoint (step 6) is corrupted, so the next segment resumes at step 3 and
    trains 4..6 again: TensorBoard, reading the folder as one run (its own directory loader),
    shows steps 1..9 once each, 4..6 from the segment that kept them (each segment's writer
    purges the steps after its start; both were shown, a zigzag over 4..6)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    spec = tiny_spec("fallback", f"file://{tmp_path}/store", training={"steps": 9, "log_every": 1,
                                                                      "checkpoint_every": 3})
    first = run(spec, Plan.data_parallel(2), until_step=6)
    victim = next((tmp_path / "store/jobs/fallback/ckpt/00000006").glob("rank*.bin"))
    data = bytearray(victim.read_bytes())
    data[len(data) // 3] ^= 0xFF
    victim.write_bytes(bytes(data))
    from parashift.launcher.launch import launch_workers

    second = launch_workers(spec, Plan.data_parallel(2))  # fresh processes: nothing held in memory
    assert second.returncode == 0 and second.start is not None and second.start.step == 3
    board = EventAccumulator(str(tmp_path / "store/jobs/fallback/metrics"))
    board.Reload()
    shown = [(e.step, e.value) for e in board.Scalars("loss")]
    assert [step for step, _ in shown] == list(range(1, 10))
    kept = {e.step: e.loss for e in first.steps if e.step <= 3} | {e.step: e.loss for e in second.steps}
    assert dict(shown) == pytest.approx(kept, rel=1e-6)


def test_metrics_can_be_switched_off(tmp_path: Path) -> None:
    spec = tiny_spec("quiet", f"file://{tmp_path}/store", training={"steps": 2}, metrics={"tensorboard": False})
    run(spec, Plan.data_parallel(1))
    assert not job_store(spec).store.exists("jobs/quiet/metrics")
    assert job_store(spec).store.list("jobs/quiet/metrics") == []


def wandb_history(path: Path) -> tuple[str, list[dict[str, float]]]:
    """(the run's group, its logged rows) from an offline run's `.wandb` file: W&B's transaction
    log (leveldb's log format: a 7-byte file header, 32 KiB blocks of checksummed chunks), each
    record parsed with W&B's own protobuf schema. wandb ships no Python reader of it any more."""
    import json
    import struct
    import zlib

    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert struct.unpack("<4sHB", data[:7])[:2] == (b":W&B", 0xBEE1)
    group, rows, position, pending = "", [], 7, b""
    while position + 7 <= len(data):
        room = 32768 - position % 32768
        checksum, length, kind = struct.unpack("<IHB", data[position:position + 7]) if room >= 7 else (0, 0, 0)
        if kind == 0:  # the rest of the block is padding
            position += room
            continue
        chunk = data[position + 7:position + 7 + length]
        assert zlib.crc32(bytes([kind]) + chunk) == checksum
        position, pending = position + 7 + length, pending + chunk
        if kind in (1, 4):  # a whole record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "run":
                group = record.run.run_group
            elif record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return group, rows


def test_an_elastic_run_also_records_offline_to_wandb(tmp_path: Path) -> None:
    """`metrics: {wandb: true}`: each segment of a 2 -> 1 run leaves an offline W&B run in the
    store, grouped by job; together they hold steps 1..6 once each, with the same loss and MFU
    as the TensorBoard files beside them."""
    spec = tiny_spec("wandb", f"file://{tmp_path}/store", training={"steps": 6, "log_every": 1},
                     metrics={"wandb": True})
    peak = measure_device("cpu").matmul_flops
    for devices, until in ((2, 3), (1, 6)):
        run(spec, Plan.data_parallel(devices, device_peak_flops=peak), until_step=until)
    folder = Path(job_store(spec).store.url_for("jobs/wandb/metrics").removeprefix("file://"))
    logs = sorted((folder / "wandb").glob("*/run-*.wandb"))
    assert len(logs) == 2, logs
    rows = []
    for log in logs:
        group, history = wandb_history(log)
        assert group == "wandb"
        rows += history
    assert sorted(row["_step"] for row in rows) == list(range(1, 7))
    board = scalars(folder)
    by_step = {row["_step"]: row for row in rows}
    assert {step: value for step, value in board["loss"]} == pytest.approx({s: by_step[s]["loss"] for s in by_step})
    assert all(0 < by_step[s]["mfu"] <= 1 for s in by_step)


def test_segments_read_in_the_order_they_ran_whatever_their_clocks_say(tmp_path: Path, monkeypatch) -> None:
    """TensorBoard reads a folder's event files in name order, and TensorBoard's names start with
    the writer's whole second: two segments started within one second (seen in CI: a warm
    segment, then a fresh launch) or on a node whose clock lags read in the wrong order, and the
    first segment's start hid the second's steps. The store's names follow the segments' order."""

    from parashift.trainer.scalars import Metrics
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.summary.writer import event_file_writer

    store = ObjectStore(f"file://{tmp_path}/store")
    clocks = iter([1_800_000_005.0, 1_800_000_001.0])  # the second segment's clock reads earlier

    class Clock:
        now = 0.0

        @staticmethod
        def time() -> float:
            return Clock.now

    monkeypatch.setattr(event_file_writer, "time", Clock)
    for first, last in ((0, 6), (3, 9)):
        Clock.now = next(clocks)
        board = Metrics(store, "skew", 1.0, 1, torch.device("cpu"), "fp32", None, first_step=first)
        for step in range(first + 1, last + 1):
            board.record(step, {"loss": float(100 * first + step)})
        board.close()
    events = EventAccumulator(str(tmp_path / "store/jobs/skew/metrics"))
    events.Reload()
    shown = {e.step: e.value for e in events.Scalars("loss")}
    assert shown == {1: 1.0, 2: 2.0, 3: 3.0, 4: 304.0, 5: 305.0, 6: 306.0, 7: 307.0, 8: 308.0, 9: 309.0}


def test_the_run_summary_names_each_plan_in_the_order_the_job_ran_them() -> None:
    from parashift.commands.run import plans_in_order

    assert plans_in_order(["dp 2, bf16 parameters", "dp 1", "dp 2, bf16 parameters"]) == (
        "dp 2, bf16 parameters -> dp 1 -> dp 2, bf16 parameters")
    assert plans_in_order(["dp 4", "dp 4", "dp 3"]) == "dp 4 -> dp 3"  # a failure's relaunch on the same plan
    assert plans_in_order([]) == ""
    # a one-process plan with no mesh said ", full AC" (seen: "dp 2, full AC, bf16 parameters -> , full AC")
    assert Plan(devices=1, mesh={}, activation_checkpointing="full").describe() == "1 device, full AC"


def test_metrics_on_an_s3_server_read_back_with_the_command_the_run_prints(s3_endpoint: str, s3_bucket: str) -> None:
    """TensorBoard reads s3:// itself, from S3_ENDPOINT's server: the run printed a bare
    `tensorboard --logdir s3://...`, which asks AWS for a bucket that lives on MinIO or moto."""
    from parashift.trainer.scalars import Metrics

    from parashift.commands.run import tensorboard_command

    options = {"client_kwargs": {"endpoint_url": s3_endpoint}}
    board = Metrics(ObjectStore(f"s3://{s3_bucket}/root", options), "remote", 1.0, 1, torch.device("cpu"), "fp32", None)
    for step in (1, 2, 3):
        board.record(step, {"loss": float(step)})
    board.close()
    url = f"s3://{s3_bucket}/root/jobs/remote/metrics"
    command = tensorboard_command(url, options)
    assert command == f"S3_ENDPOINT={s3_endpoint} tensorboard --logdir {url}"
    assert tensorboard_command("file:///x/metrics", options) == "tensorboard --logdir file:///x/metrics"
    # As the command runs it: TensorBoard's S3 reader takes S3_ENDPOINT once, when it is imported.
    read = ("from tensorboard.backend.event_processing.event_accumulator import EventAccumulator as E\n"
            f"e = E({url!r}); e.Reload(); print([(s.step, s.value) for s in e.Scalars('loss')])")
    env = {**os.environ, "S3_ENDPOINT": command.split()[0].removeprefix("S3_ENDPOINT=")}
    shown = subprocess.run([sys.executable, "-c", read], env=env, capture_output=True, text=True, timeout=120)
    assert shown.stdout.strip() == "[(1, 1.0), (2, 2.0), (3, 3.0)]", shown.stderr[-2000:]


def test_a_long_segment_copies_its_scalars_in_bounded_pieces_and_tensorboard_reads_each_step_once(
        tmp_path: Path, monkeypatch) -> None:
    """Each copy to the store rewrites a whole object (S3 has no append): the event file copied
    after every logged step cost the square of a segment's length. Past ROTATE_BYTES a segment
    goes on in a new file, a growing file is copied at most every UPLOAD_EVERY_S, and at once
    when asked (a commit) and at the end. TensorBoard, reading the folder as one run, still shows
    every step once, with a later segment that trains steps again (a fallback) hiding the earlier
    copies of them."""
    from parashift.trainer import scalars
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setattr(scalars, "ROTATE_BYTES", 4096, raising=False)
    monkeypatch.setattr(scalars, "UPLOAD_EVERY_S", 3600.0, raising=False)  # nothing copied by the clock in this test
    store = ObjectStore(f"file://{tmp_path}/store")
    folder = tmp_path / "store/jobs/long/metrics"

    def copies_settle(expected_puts: int) -> None:
        """The store's count of copies reaches `expected_puts` (the uploader's thread) and stays there."""
        deadline = time.monotonic() + 30
        while store.stats.put_requests < expected_puts and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.2)
        assert store.stats.put_requests == expected_puts

    def settled() -> int:
        """The store's count of copies once the uploader's thread has made none for a while."""
        seen = -1
        while store.stats.put_requests != seen:
            seen = store.stats.put_requests
            time.sleep(0.3)
        return seen

    board = scalars.Metrics(store, "long", 1.0, 1, torch.device("cpu"), "fp32", None, first_step=0)
    tags = ("loss", "grad_norm", "lr", "tokens_per_s", "step_s")
    board.record(1, {tag: 1.0 for tag in tags})
    copies_settle(1)  # the first copy at once
    for step in range(2, 41):
        board.record(step, {tag: float(step) for tag in tags})
    puts = settled()
    finished = len(list(folder.iterdir())) - 1
    assert finished >= 2 and puts == 1 + 2 * finished  # each finished file's last copy and its successor's first
    board.flush()  # a commit: what is recorded is copied now
    copies_settle(2 + 2 * finished)
    for step in range(41, 61):
        board.record(step, {tag: float(step) for tag in tags})
    board.close()
    assert max(p.stat().st_size for p in folder.iterdir()) < 4096 + 1024  # no copy is much over the bound
    # A fallback to step 50: the next segment trains 51..70, its copies of 51..60 are the ones shown
    board = scalars.Metrics(store, "long", 1.0, 1, torch.device("cpu"), "fp32", None, first_step=50)
    for step in range(51, 71):
        board.record(step, {tag: 1000.0 + step for tag in tags})
    board.close()
    events = EventAccumulator(str(folder))
    events.Reload()
    for tag in tags:
        shown = {e.step: e.value for e in events.Scalars(tag)}
        assert len(events.Scalars(tag)) == 70 and sorted(shown) == list(range(1, 71)), tag
        assert shown[50] == 50.0 and shown[51] == 1051.0 and shown[70] == 1070.0


def test_a_killed_writers_local_folder_is_removed_by_the_next_and_a_live_ones_is_not(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 killed mid-segment leaves its local copy folder; the next writer on the machine
    removes it, never one whose owner still runs (nor a folder it did not make)."""
    import select
    import signal
    import tempfile

    from parashift.trainer.scalars import _LocalFolder

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def owner() -> tuple[int, Path]:
        """A process holding a folder until it is killed."""
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: make a folder, say where, wait to be killed
            try:
                os.write(write, _LocalFolder("parashift-metrics-").name.encode())
                time.sleep(60)
            finally:
                os._exit(0)
        os.close(write)
        ready, _, _ = select.select([read], [], [], 30)  # a child stuck after fork fails the test, not hangs it
        name = os.read(read, 4096).decode() if ready else ""
        os.close(read)
        if not name:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError("the folder's owner said nothing within 30 s")
        return pid, Path(name)

    killed, killed_folder = owner()
    alive, alive_folder = owner()
    foreign = tmp_path / "parashift-metrics-foreign"  # no lock file: not one _LocalFolder made
    foreign.mkdir()
    try:
        os.kill(killed, signal.SIGKILL)
        os.waitpid(killed, 0)
        assert killed_folder.is_dir() and alive_folder.is_dir()
        mine = _LocalFolder("parashift-metrics-")
        mine.swept.join(timeout=30)
        assert not killed_folder.exists()
        assert alive_folder.is_dir() and foreign.is_dir() and Path(mine.name).is_dir()
        mine.cleanup()
        assert not Path(mine.name).exists()
    finally:
        os.kill(alive, signal.SIGKILL)
        os.waitpid(alive, 0)


def test_steps_a_killed_rank_0_had_not_copied_are_filled_from_its_reports_once(tmp_path: Path, monkeypatch) -> None:
    """Rank 0 recorded steps 1..5 and died with only 1..3 copied to the store; its peers held
    step 6 (rank 0 died in it), and the job went on from 7. It died again having copied 7, 8 of
    7..10, and the job went on from 11. TensorBoard showed 1..3, 7, 8, 11, 12: the report fills
    4..6 and 9, 10 from what the flow heard (6 with its loss alone), each step once and in the
    order TensorBoard draws them, and a second fill finds nothing to do."""
    from parashift.launcher.launch import LaunchResult
    from parashift.pool.step_times import measured
    from parashift.tasks.launch import scalars_between
    from parashift.trainer import scalars
    from parashift.trainer.events import HeldEvent, StepEvent

    def reports(steps: range) -> list[StepEvent]:
        return [StepEvent(step=s, loss=20.0 - s, step_s=0.1, tokens_per_s=100.0, grad_norm=1.0) for s in steps]

    store = ObjectStore(f"file://{tmp_path}/store")
    first = scalars_between(LaunchResult(-9, [*reports(range(1, 6)), HeldEvent(step=6, rank=1, loss=3.5)]), 2, 0, 6)
    assert [step for step, _ in first] == [1, 2, 3, 4, 5, 6] and first[5][1] == {"loss": 3.5}
    assert first[0][1]["devices"] == 2.0 and first[0][1]["step_s"] == 0.1
    second = scalars_between(LaunchResult(-9, reports(range(7, 11))), 2, 6, 10)
    monkeypatch.setattr(scalars, "UPLOAD_EVERY_S", 3600.0, raising=False)
    for start, copied in ((0, first[:3]), (6, second[:2]), (10, [(s, {"loss": 20.0 - s}) for s in (11, 12)])):
        board = scalars.Metrics(store, "gap", 1.0, 2, torch.device("cpu"), "fp32", None, first_step=start)
        for step, values in copied:
            board.record(step, values)
        board.close()  # what was copied (rank 0's later records went with it)
    assert scalars.shown_steps(store, "gap") == {1, 2, 3, 7, 8, 11, 12}
    speed = measured(store, "gap")
    assert scalars.fill_gaps(store, "gap", first + second) == [4, 5, 6, 9, 10]
    assert scalars.fill_gaps(store, "gap", first + second) == []
    assert measured(store, "gap") == speed, "a pool reads no change into the fill's wall times"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "store/jobs/gap/metrics"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(s, 3.5 if s == 6 else 20.0 - s) for s in range(1, 13)]
    assert [e.step for e in events.Scalars("step_s")] == [1, 2, 3, 4, 5, 7, 8, 9, 10]
