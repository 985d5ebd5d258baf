"""The metrics component (after torchtitan's `components/metrics.py`): per logged step, loss,
gradient norm, learning rate, tokens/s, TFLOP/s and MFU per device, memory and data wait, as
TensorBoard event files in the job's storage under `jobs/{job}/metrics/`.

Rank 0 writes them with TensorBoard's own writer into a local folder and copies each event
file to the store in the background (any fsspec URL: local files, S3), so a slow store never
holds a step. Every segment of a job (each launch, each device count) writes its own event
file into the same folder: `tensorboard --logdir` shows an elastic run as one curve per tag
over steps, each step once (a segment that trains steps again, after a failure or a fallback to
an older checkpoint, hides the earlier file's copies of them: TensorBoard's `purge_step`).

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
import resource
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch

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


class _Uploader:
    """Copies the local event file to the store, in a thread of its own: at most one copy in
    flight, a request made during one is served by one more copy after it."""

    def __init__(self, store: Any, key: str, path: Path) -> None:
        self.store, self.key, self.path = store, key, path
        self._wanted = threading.Event()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="metrics-upload", daemon=True)
        self._thread.start()

    def request(self) -> None:
        self._wanted.set()

    def _run(self) -> None:
        while True:
            self._wanted.wait()
            self._wanted.clear()
            with contextlib.suppress(Exception):  # metrics never fail a job; the next copy tries again
                self.store.put(self.key, self.path.read_bytes())
            if self._closing and not self._wanted.is_set():
                return

    def close(self) -> None:
        self._closing = True
        self._wanted.set()
        self._thread.join(timeout=30)


_EVENTS = "events.out.tfevents."


def _name_after(store: Any, job_id: str, name: str) -> str:
    """`name` (TensorBoard's: `events.out.tfevents.<whole second>.<host>.<pid>...`) with its
    second raised past every event file already in the job's folder. TensorBoard reads a folder's
    files in name order and a segment's start hides the steps after it in files read before, so a
    segment started within the same second as the one before it (seen: a warm segment, then a
    fresh launch), or on a node whose clock lags, would be read first and hidden by its predecessor.
    One writer per job (the lease) makes the folder's newest name the previous segment's."""
    second, _, rest = name.removeprefix(_EVENTS).partition(".")
    taken = [key.rpartition("/")[2].removeprefix(_EVENTS).partition(".")[0]
             for key in store.list(f"jobs/{job_id}/metrics") if _EVENTS in key]
    newest = max((int(each) for each in taken if each.isdigit()), default=-1)
    return f"{_EVENTS}{max(int(second), newest + 1):010d}.{rest}"


class _TensorBoard:
    """TensorBoard's own writer into a local folder; each flush copies the event file to the store."""

    def __init__(self, store: Any, job_id: str, first_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._folder = tempfile.TemporaryDirectory(prefix="parashift-metrics-")
        # `purge_step`: TensorBoard hides the steps from here on that earlier files hold, so a
        # segment that trains again what a failed one had logged past its last commit (or a job
        # started over) shows each step once, the one kept; nothing is hidden after a planned change.
        self._writer = SummaryWriter(self._folder.name, filename_suffix=f".from-step-{first_step:08d}",
                                     purge_step=first_step + 1)
        path = Path(self._writer.file_writer.event_writer._file_name)
        self._uploader = _Uploader(store, f"jobs/{job_id}/metrics/{_name_after(store, job_id, path.name)}", path)

    def record(self, step: int, values: dict[str, float]) -> None:
        for name, value in values.items():
            self._writer.add_scalar(name, value, step)
        self._writer.flush()
        self._uploader.request()

    def close(self) -> None:
        self._writer.close()
        self._uploader.close()
        self._folder.cleanup()


class _WandB:
    """An offline W&B run per segment (grouped by job, named by its first step); its `.wandb`
    file is copied to the store as it grows and once more when the run is finished."""

    def __init__(self, store: Any, job_id: str, project: str, first_step: int, config: dict[str, Any]) -> None:
        import wandb  # optional (`pip install parashift[wandb]`); imported only where asked for

        self._folder = tempfile.TemporaryDirectory(prefix="parashift-wandb-")
        # Offline: nothing leaves the machine; git and system sampling off (a rank's time is the job's).
        settings = wandb.Settings(mode="offline", silent=True, console="off", disable_git=True, x_disable_stats=True)
        self._run = wandb.init(project=project, group=job_id, job_type="train", name=f"{job_id}-from-step-{first_step}",
                               dir=self._folder.name, config=config, settings=settings)
        log = Path(self._run.dir).parent / f"run-{self._run.id}.wandb"  # beside files/: the run's transaction log
        self._uploader = _Uploader(store, f"jobs/{job_id}/metrics/wandb/{log.parent.name}/{log.name}", log)

    def record(self, step: int, values: dict[str, float]) -> None:
        self._run.log(values, step=step)
        self._uploader.request()

    def close(self) -> None:
        import wandb

        self._run.finish()
        # `finish` can return before W&B's service has written the run's records: the file was
        # still its 7-byte header in 5 of 20 closes measured, and that copy was the last. The
        # service's teardown waits for them (the next segment's `init` starts another).
        wandb.teardown()
        self._uploader.close()
        self._folder.cleanup()


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

    def close(self) -> None:
        for sink in self._sinks:
            sink.close()
        self._sinks = []
