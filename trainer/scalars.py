"""The metrics component (after torchtitan's `components/metrics.py`): per logged step, loss,
gradient norm, learning rate, tokens/s, TFLOP/s and MFU per device, memory and data wait, as
TensorBoard event files in the job's storage under `jobs/{job}/metrics/`.

Rank 0 writes them with TensorBoard's own writer into a local folder and copies each event
file to the store in the background (any fsspec URL: local files, S3), so a slow store never
holds a step: at most once a second, and at once at each commit and at the end (a segment's
file continues in a new one past 64 KiB, as each copy rewrites a whole object). Every segment
of a job (each launch, each device count) writes its own event file into the same folder:
`tensorboard --logdir` shows an elastic run as one curve per tag over steps, each step once (a
segment that trains steps again, after a failure or a fallback to an older checkpoint, hides
the earlier file's copies of them: TensorBoard's `purge_step`).

MFU divides the model's training FLOPs per token (PaLM's 6N + attention, the family's
`flops_per_token`) at the measured tokens/s, per device, by the device's peak: a GPU's dense
bf16 (or fp32) rate from the table below by name, or on CPU the GEMM rate measured with one
worker's threads at its share of the cores (`Plan.device_peak_flops`, `planner.profile.peak_flops`).

Optionally (`metrics.wandb`) the same scalars go to Weights & Biases in offline mode, as
torchtitan offers: no account and no network while training; each segment is one offline run
(grouped by job) whose `.wandb` file is copied to `jobs/{job}/metrics/wandb/`, and
`wandb sync <that file or folder>` uploads it later.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import resource
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
from parashift.trainer.events import FILLED_SUFFIX

# Dense peak FLOP/s by device name (vendor data sheets, without sparsity): bf16, fp32.
GPU_PEAK_FLOPS = {
    "H200": (989e12, 67e12),
    "H100": (989e12, 67e12),
    "A100": (312e12, 19.5e12),
    "L40S": (362e12, 91.6e12),
    "A10G": (70e12, 31.2e12),
}


def peak_flops(device: torch.device, precision: str, measured: float | None) -> float | None:
    """The device's peak FLOP/s for `precision`: by GPU name, else the measured GEMM rate."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, (bf16, fp32) in GPU_PEAK_FLOPS.items():
            if key in name:
                return bf16 if precision == "bf16" else fp32
    return measured


def memory_bytes(device: torch.device) -> int:
    """This process's peak memory: the CUDA allocator's, else the process's resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


# Each copy rewrites a whole object (S3 has no append): a segment's event file copied after every
# logged step cost the square of its length (~450 bytes a step: a 100k-step segment rewrote up to
# 45 MB at each step). A segment's TensorBoard file is continued in a new one past ROTATE_BYTES, so
# no copy exceeds it, and a growing file is copied at most once a second (steps of a second or
# more: each, as before), at once at a commit and at the segment's end. Rank 0 killed loses at
# most the last second's scalars; where its peers hold a later step and the job resumes past
# them (warm workers), the job's report records them from rank 0's reports (`fill_gaps`).
UPLOAD_EVERY_S = 1.0
ROTATE_BYTES = 64 * 1024


class _Uploader:
    """Copies a local file to the store, in a thread of its own: the first copy at once, later
    ones at most every UPLOAD_EVERY_S unless asked for `now`; one in flight at a time. `switch`
    moves on to the next file of a sequence: the one before gets its last copy at once, before
    the next one's first, so the store never holds a file after one that is still growing."""

    def __init__(self, store: Any, key: str, path: Path) -> None:
        self.store, self._current = store, (key, path)
        self._finished: list[tuple[str, Path]] = []
        self._lock = threading.Lock()
        self._wanted, self._now = threading.Event(), threading.Event()
        self._last = float("-inf")
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="metrics-upload", daemon=True)
        self._thread.start()

    def request(self, now: bool = False) -> None:
        if now:
            self._now.set()
        self._wanted.set()

    def switch(self, key: str, path: Path) -> None:
        with self._lock:
            self._finished.append(self._current)
            self._current = (key, path)
        self.request(now=True)  # a finished file's last copy (and the next one's first) at once

    def _copy(self, key: str, path: Path) -> None:
        with contextlib.suppress(Exception):  # metrics never fail a job; the next copy tries again
            self.store.put(key, path.read_bytes())

    def _run(self) -> None:
        while True:
            self._wanted.wait()
            self._now.wait(timeout=max(0.0, self._last + UPLOAD_EVERY_S - time.monotonic()))
            self._wanted.clear()
            self._now.clear()
            with self._lock:
                finished, self._finished = self._finished, []
                current = self._current
            for key, path in finished:
                self._copy(key, path)
                path.unlink(missing_ok=True)
            self._copy(*current)
            self._last = time.monotonic()
            if self._closing and not self._wanted.is_set():
                return

    def close(self) -> None:
        self._closing = True
        self.request(now=True)
        self._thread.join(timeout=30)


_EVENTS = "events.out.tfevents."
_LOCK = ".owner"


class _LocalFolder:
    """A folder for a sink's files on their way to the store, removed at `cleanup`.

    Rank 0 is a process a failure or a pool's preemption may kill, and a killed process removes
    nothing: its folder (seen: 345 in one machine's temporary directory) is removed by the next
    one made there. The owner holds a lock on a file inside for as long as it lives; the kernel
    drops it when the owner dies, however it dies, so a folder whose lock is free is one nobody
    writes (a pid would not say so across PID namespaces sharing one /tmp). What it held was
    copied to the store as it was written, or is lost with its process either way."""

    def __init__(self, prefix: str) -> None:
        self.name = tempfile.mkdtemp(prefix=prefix)
        # Locked before it takes the name a sweep looks for: a sweep never finds it free.
        self._lock = os.open(os.path.join(self.name, f"{_LOCK}.new"), os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self._lock, fcntl.LOCK_EX)
        os.rename(os.path.join(self.name, f"{_LOCK}.new"), os.path.join(self.name, _LOCK))
        # In the background: a segment's start is on a change's path, and a sweep reads the whole
        # temporary directory (3.6 ms beside 347 older folders, measured).
        self.swept = threading.Thread(target=_sweep, args=(prefix,), name="parashift-metrics-sweep", daemon=True)
        self.swept.start()

    def cleanup(self) -> None:
        shutil.rmtree(self.name, ignore_errors=True)
        os.close(self._lock)


def _sweep(prefix: str) -> None:
    for left in Path(tempfile.gettempdir()).glob(f"{prefix}*"):
        _remove_if_unowned(left)


def _remove_if_unowned(folder: Path) -> None:
    """Remove `folder` if no live process holds its lock (another user's is left alone)."""
    try:
        lock = os.open(folder / _LOCK, os.O_RDWR)
    except OSError:  # not one this code made (another user's, or an older version's), or gone
        return
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # its owner lives
        os.close(lock)
        return
    shutil.rmtree(folder, ignore_errors=True)
    os.close(lock)


def _name_after(store: Any, job_id: str, name: str, after: int = -1) -> str:
    """`name` (TensorBoard's: `events.out.tfevents.<whole second>.<host>.<pid>...`) with its
    second raised past every event file already in the job's folder, and past `after` (the
    segment's previous file, which may not be copied yet). TensorBoard reads a folder's files in
    name order and a segment's start hides the steps after it in files read before, so a
    segment started within the same second as the one before it (seen: a warm segment, then a
    fresh launch), or on a node whose clock lags, would be read first and hidden by its predecessor.
    One writer per job (the lease) makes the folder's newest name the previous segment's."""
    second, _, rest = name.removeprefix(_EVENTS).partition(".")
    taken = [_second_of(key) for key in store.list(f"jobs/{job_id}/metrics") if _EVENTS in key]
    newest = max((each for each in taken if each is not None), default=-1)
    return f"{_EVENTS}{max(int(second), newest + 1, after + 1):010d}.{rest}"


def _second_of(key: str) -> int | None:
    """The whole second an event file's name starts with (None: not one TensorBoard names)."""
    second = key.rpartition("/")[2].removeprefix(_EVENTS).partition(".")[0]
    return int(second) if second.isdigit() else None


class _TensorBoard:
    """TensorBoard's own writer into a local folder, copied to the store (`_Uploader`); a segment
    continues in a new file past ROTATE_BYTES."""

    def __init__(self, store: Any, job_id: str, first_step: int, filling: str | None = None) -> None:
        self._store, self._job_id = store, job_id
        self._folder = _LocalFolder("parashift-metrics-")
        # `purge_step`: TensorBoard hides the steps from here on that earlier files hold, so a
        # segment that trains again what a failed one had logged past its last commit (or a job
        # started over) shows each step once, the one kept; nothing is hidden after a planned change.
        # `filling`: a file of steps the others lack (`fill_gaps`), written whole under that name.
        self._writer, path = self._open(f".from-step-{first_step:08d}", purge_step=None if filling else first_step + 1)
        self._rotates = filling is None
        self._key = f"jobs/{job_id}/metrics/{filling or _name_after(store, job_id, path.name)}"
        self._uploader = _Uploader(store, self._key, path)

    def _open(self, suffix: str, purge_step: int | None = None) -> tuple[Any, Path]:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(self._folder.name, filename_suffix=suffix, purge_step=purge_step)
        return writer, Path(writer.file_writer.event_writer._file_name)

    def record(self, step: int, values: dict[str, float]) -> None:
        for name, value in values.items():
            self._writer.add_scalar(name, value, step)
        self._writer.flush()
        if self._rotates and Path(self._writer.file_writer.event_writer._file_name).stat().st_size >= ROTATE_BYTES:
            self._writer.close()  # the rest of the segment goes on in a new file, read after this one
            self._writer, path = self._open(f".from-step-{step + 1:08d}")
            self._key = (f"jobs/{self._job_id}/metrics/"
                         f"{_name_after(self._store, self._job_id, path.name, _second_of(self._key) or -1)}")
            self._uploader.switch(self._key, path)
        else:
            self._uploader.request()

    def flush(self) -> None:
        self._uploader.request(now=True)  # `record` flushed the writer: the file holds every step recorded

    def close(self) -> None:
        self._writer.close()
        self._uploader.close()
        self._folder.cleanup()


class _WandB:
    """An offline W&B run per segment (grouped by job, named by its first step); its `.wandb`
    file is copied to the store as it grows and once more when the run is finished."""

    def __init__(self, store: Any, job_id: str, project: str, first_step: int, config: dict[str, Any]) -> None:
        import wandb  # optional (`pip install parashift[wandb]`); imported only where asked for

        self._folder = _LocalFolder("parashift-wandb-")
        # Offline: nothing leaves the machine; git and system sampling off (a rank's time is the job's).
        settings = wandb.Settings(mode="offline", silent=True, console="off", disable_git=True, x_disable_stats=True)
        self._run = wandb.init(project=project, group=job_id, job_type="train", name=f"{job_id}-from-step-{first_step}",
                               dir=self._folder.name, config=config, settings=settings)
        log = Path(self._run.dir).parent / f"run-{self._run.id}.wandb"  # beside files/: the run's transaction log
        self._uploader = _Uploader(store, f"jobs/{job_id}/metrics/wandb/{log.parent.name}/{log.name}", log)

    def record(self, step: int, values: dict[str, float]) -> None:
        self._run.log(values, step=step)
        self._uploader.request()

    def flush(self) -> None:
        self._uploader.request(now=True)

    def close(self) -> None:
        import wandb

        self._run.finish()
        # `finish` can return before W&B's service has written the run's records: the file was
        # still its 7-byte header in 5 of 20 closes measured, and that copy was the last. The
        # service's teardown waits for them (the next segment's `init` starts another).
        wandb.teardown()
        self._uploader.close()
        self._folder.cleanup()


def shown_steps(store: Any, job_id: str, tag: str = "loss") -> set[int]:
    """The steps TensorBoard shows for `tag` in the job's metrics folder, read as one run (its
    own reader, each segment's purge applied), from a local copy: the reader wants files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    keys = sorted(k for k in store.list(f"jobs/{job_id}/metrics") if _EVENTS in k.rpartition("/")[2])
    with tempfile.TemporaryDirectory(prefix="parashift-metrics-read-") as folder:
        for key in keys:
            (Path(folder) / key.rpartition("/")[2]).write_bytes(store.get(key))
        board = EventAccumulator(folder, size_guidance={"scalars": 0})
        board.Reload()
        return {e.step for e in board.Scalars(tag)} if tag in board.Tags()["scalars"] else set()


def fill_gaps(store: Any, job_id: str, records: list[tuple[int, dict[str, float]]]) -> list[int]:
    """Record the steps of `records` TensorBoard does not show; the steps filled. Warm workers
    that outlive a killed rank 0 resume past steps it had logged but not yet copied to the store
    (at most its last second of them), and past the step they hold where rank 0 died in it: the
    flow heard those steps' reports, and records them here once the job ends.

    Event files without a purge (they hide nothing), each named to be read right after the last
    file of the segment its steps belong to (the newest that started before them), so before the
    segments that came after: TensorBoard draws a tag's points in the order it reads them."""
    shown = shown_steps(store, job_id)
    missing = sorted({step: values for step, values in records if step not in shown}.items())
    names = [key.rpartition("/")[2] for key in store.list(f"jobs/{job_id}/metrics")]
    after: dict[str, list[tuple[int, dict[str, float]]]] = {}
    for step, values in missing:
        read_after = max((name for name in names if (first := _first_step_of(name)) is not None and first < step),
                         default=_EVENTS)
        after.setdefault(read_after, []).append((step, values))
    for name, steps in after.items():
        board = _TensorBoard(store, job_id, steps[0][0] - 1, filling=f"{name}{FILLED_SUFFIX}")
        try:
            for step, values in steps:
                board.record(step, values)
        finally:
            board.close()
    return [step for step, _ in missing]


def _first_step_of(name: str) -> int | None:
    """The step an event file's segment started from (its `.from-step-` suffix), if it says."""
    found = re.search(r"\.from-step-(\d+)", name)
    return int(found.group(1)) if found else None


class Metrics:
    """Rank 0's metrics for one segment of a job. `record` once per logged step; `close` at the end."""

    def __init__(self, store: Any, job_id: str, flops_per_token: float, world_size: int, device: torch.device,
                 precision: str, measured_peak_flops: float | None, tensorboard: bool = True,
                 first_step: int = 0, wandb_project: str | None = None) -> None:
        self.flops_per_token, self.world_size, self.device = flops_per_token, world_size, device
        self.peak = peak_flops(device, precision, measured_peak_flops)
        self._sinks: list[_TensorBoard | _WandB] = []
        if tensorboard:
            self._sinks.append(_TensorBoard(store, job_id, first_step))
        if wandb_project is not None:
            config = {"job": job_id, "devices": world_size, "first_step": first_step, "precision": precision}
            self._sinks.append(_WandB(store, job_id, wandb_project, first_step, config))

    def numbers(self, tokens_per_s: float) -> dict[str, float | None]:
        """TFLOP/s and MFU per device at a job-wide `tokens_per_s`, and this rank's memory."""
        per_device = self.flops_per_token * tokens_per_s / self.world_size
        mfu = per_device / self.peak if self.peak else None
        return {"tflops": per_device / 1e12, "mfu": mfu, "memory_gib": memory_bytes(self.device) / 2**30}

    def record(self, step: int, values: dict[str, float | None]) -> None:
        """Write one logged step's scalars (None values are left out) and start their upload."""
        present = {name: value for name, value in values.items() if value is not None}
        for sink in self._sinks:
            sink.record(step, present)

    def flush(self) -> None:
        """Copy what is recorded to the store now (a checkpoint was committed: the steps up to it
        are never trained again, so a crash after this must not lose their scalars)."""
        for sink in self._sinks:
            sink.flush()

    def close(self) -> None:
        for sink in self._sinks:
            sink.close()
        self._sinks = []
