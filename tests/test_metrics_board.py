"""The metrics component writes TensorBoard event files into the job's storage: each segment of
an elastic run its own file, read back with TensorBoard's own reader as one curve per tag."""

from __future__ import annotations

from pathlib import Path

import pytest
from jobs import run, tiny_spec
from parashift.planner.profile import measure_device
from parashift.specs.plan import Plan
from parashift.storage import job_store

pytestmark = pytest.mark.slow


def scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] over every event file in `folder`, by tensorboard's EventAccumulator."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(folder.iterdir()):
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


def test_metrics_can_be_switched_off(tmp_path: Path) -> None:
    spec = tiny_spec("quiet", f"file://{tmp_path}/store", training={"steps": 2}, metrics={"tensorboard": False})
    run(spec, Plan.data_parallel(1))
    assert not job_store(spec).store.exists("jobs/quiet/metrics")
    assert job_store(spec).store.list("jobs/quiet/metrics") == []
