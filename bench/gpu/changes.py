"""Part 5 of the GPU check, changes on the GPU: one plan change, dp 2 -> dp 1 after step 4 of 8,
three ways, on a tiny GPT (fp32, no dropout, the same seed). Two ranks share the one GPU over
gloo (NCCL refuses two ranks on one device).

- `relaunch`: torchrun workers as interpreters of their own (forking off), stopped at step 4
  (`until_step`, committed), then a fresh launch on one rank resuming from that checkpoint.
- `warm`: the same change on warm workers (`WarmPool`, `launch_warm`), as a flow run makes it:
  a stop object naming the next device count, so the ranks hold step 4 in memory instead of
  saving it, and the next segment on the same processes restores it from there. (A first
  segment to step 3 puts the stop's step at 4 exactly: rank 0 reads the stop object at the
  first step of the segment after it.)
- `forked_relaunch`: `relaunch` with the workers forked by the forkserver, which CUDA jobs get
  only with PARASHIFT_FORK_CUDA=1; whether the running forkserver loaded NVIDIA's driver
  library (`forkserver_cuda_initialised`: it must never initialise CUDA, or a forked worker's
  CUDA breaks) and how many ranks really were forked.
- `equal`: the final committed state (model and optimizer tensors) of each pair, bit for bit,
  and every step's loss (CUDA kernels may differ run to run: reported, not asserted).

`downtime_s`: from the last step event of the segment before the change to the first step
event after it, as the launcher heard them (warm workers' events are read from files polled
every 50 ms). Whether forking CUDA workers should become the default: `forked_relaunch`
downtime below `relaunch`'s, its ranks forked, the forkserver without CUDA, and `equal` bitwise.

    python -m parashift.bench.gpu.changes --dir /local/disk/folder                 # on the GPU machine
    python -m parashift.bench.gpu.changes --device cpu --tiny --dir /tmp/folder    # a smoke run of the same code
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from parashift.bench.gpu.common import case, device_name, part_args
from parashift.launcher.forkserver import cuda_loaded
from parashift.launcher.forkservers import stop_all
from parashift.launcher.launch import (
    FORK_CUDA_ENV,
    LaunchResult,
    RunningWorkers,
    forkserver_pids,
    launch_workers,
)
from parashift.launcher.processes import parent_of
from parashift.launcher.warm_launch import launch_warm
from parashift.launcher.warm_pool import WarmPool
from parashift.specs import JobSpec
from parashift.specs.environ import FORK_WORKERS, FORKSERVER_DIR
from parashift.specs.plan import Plan
from parashift.storage import JobPaths, job_store, open_store
from parashift.tasks.credentials import environment  # Prefect-free: the device has no Prefect
from parashift.trainer.checkpoint import load_tensors
from parashift.trainer.events import StartEvent, StepEvent, StoppedEvent, WorkerEvent

PART = "changes"
STEPS, CHANGE_AT = 8, 4
# A segment that has not ended by then is ended (a hung collective, a worker that never started):
# the case fails, the next one runs.
SEGMENT_TIMEOUT_S = 180.0


def job_spec(name: str, device: str, tiny: bool, root: Path) -> JobSpec:
    """The tiny_spec of the tests, 2 layers (a few MB of state on the GPU): saves only where a
    segment ends, every step reported."""
    shape = {"n_layers": 2, "d_model": 32, "n_heads": 2, "seq_len": 32} if tiny else \
        {"n_layers": 2, "d_model": 256, "n_heads": 4, "seq_len": 128}
    return JobSpec.model_validate({
        "name": name,
        "model": {**shape, "vocab_size": 256, "dropout": 0.0},
        "data": {"url": "builtin://python-stdlib", "max_bytes": 200_000},
        "optimizer": {"lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 2},
        "training": {"global_batch": 8, "micro_batch": 2, "steps": STEPS, "seed": 7, "checkpoint_every": 1000,
                     "log_every": 1, "hang_timeout_s": 120, "stop_poll_s": 0},
        # NCCL refuses two ranks on one GPU; on CPU gloo is the default anyway.
        "resources": {"devices": 2, "kind": device, "backend": "gloo"},
        "parallelism": {"precision": "fp32", "compile": False},
        "storage": {"url": f"file://{root / name}"},
    })


class Segment:
    """One launch's events as they came: when its first and last step were heard (time.time())
    and, at its start, how many of its ranks a forkserver of this process forked."""

    def __init__(self, devices: int) -> None:
        self.devices = devices
        self.first_step_at: float | None = None
        self.last_step_at: float | None = None
        self.forked_ranks: int | None = None
        self.result: LaunchResult | None = None
        self.wall_s = 0.0
        self.workers = RunningWorkers()

    def on_event(self, event: WorkerEvent) -> None:
        if isinstance(event, StepEvent):
            now = time.time()
            self.first_step_at = self.first_step_at or now
            self.last_step_at = now
        elif isinstance(event, StartEvent):
            servers = forkserver_pids()
            self.forked_ranks = sum(parent_of(pid) in servers for pid in event.pids)

    def run(self, launch: Callable[[Segment], LaunchResult]) -> LaunchResult:
        """`launch(self)`, ended after SEGMENT_TIMEOUT_S; a failed launch raises."""
        timer = threading.Timer(SEGMENT_TIMEOUT_S, self.workers.kill)
        timer.start()
        started = time.perf_counter()
        try:
            self.result = launch(self)
        finally:
            timer.cancel()
            self.wall_s = time.perf_counter() - started
        if self.result.returncode != 0:
            reason = f" (hung {self.result.hung_s} s)" if self.result.hung_s else ""
            raise RuntimeError(f"segment on {self.devices} devices exited with {self.result.returncode}{reason}")
        return self.result

    def report(self) -> dict[str, Any]:
        result = self.result
        if result is None:
            return {"devices": self.devices, "wall_s": round(self.wall_s, 2)}
        start, restoring = result.start, result.restoring
        return {"devices": self.devices, "rc": result.returncode, "wall_s": round(self.wall_s, 2),
                "resumed_step": start.step if start else None, "final_step": result.final_step,
                "stopped": result.stopped, "held_unsaved": any(e.pending for e in result.of(StoppedEvent)),
                "restore_s": start.restore_s if start else None,
                "restore_bytes": start.restore_bytes if start else None,
                "bytes_live": restoring.bytes_live if restoring else None,
                "phases": {k: v if v is None else round(v, 3) for k, v in start.phases.items()} if start else None,
                "forked_ranks": self.forked_ranks}


def downtime(before: Segment, after: Segment) -> float | None:
    if before.last_step_at is None or after.first_step_at is None:
        return None
    return round(after.first_step_at - before.last_step_at, 3)


def losses(segments: list[Segment]) -> dict[int, float]:
    """Each step's loss, as the segment that kept it reported it."""
    return {e.step: e.loss for s in segments if s.result is not None for e in s.result.steps}


def final_state(spec: JobSpec) -> dict[str, torch.Tensor]:
    """Parameters and optimizer state of the newest committed checkpoint (tests/jobs.py's)."""
    store = job_store(spec)
    manifest = store.latest()
    if manifest is None:
        raise RuntimeError(f"no committed checkpoint for {spec.job_id}")
    if manifest.step != STEPS:
        raise RuntimeError(f"{spec.job_id}'s newest checkpoint is of step {manifest.step}, not {STEPS}")
    return load_tensors(store, manifest, [n for n in manifest.tensors if n.startswith(("model/", "optim/"))])


def on_line(line: str) -> None:
    """Workers' output: stderr (stdout is for the JSON lines)."""
    print(line, file=sys.stderr)


def relaunch(spec: JobSpec, env: dict[str, str], segments: list[Segment]) -> dict[str, Any]:
    """dp 2 to step CHANGE_AT through torchrun, then a fresh torchrun of dp 1 from its checkpoint
    (`segments`: the two, filled in as they run)."""
    first, second = segments
    first.run(lambda s: launch_workers(spec, Plan.data_parallel(2), on_line=on_line, on_event=s.on_event,
                                       until_step=CHANGE_AT, extra_env=env, workers=s.workers))
    second.run(lambda s: launch_workers(spec, Plan.data_parallel(1), on_line=on_line, on_event=s.on_event,
                                        extra_env=env, workers=s.workers))
    resumed = second.result.start.step if second.result and second.result.start else None
    if resumed != CHANGE_AT:
        raise RuntimeError(f"the second segment resumed at step {resumed}, not {CHANGE_AT}")
    return {"downtime_s": downtime(first, second)}


def warm(spec: JobSpec, env: dict[str, str], segments: list[Segment]) -> dict[str, Any]:
    """The change on warm workers as `tasks.launch.launch_training` makes it, without Prefect:
    the stop object (written before the stop is heard) names the next segment's device count.
    `segments`: dp 2 to CHANGE_AT - 1, dp 2 stopped at CHANGE_AT, dp 1 to the end."""
    warmup, before, after = segments
    store = open_store(spec.storage)
    stop_key = JobPaths(spec.job_id).stop()
    started = time.perf_counter()
    pool = WarmPool(2, spec.resources.kind)
    try:
        store.delete(stop_key)
        warmup.run(lambda s: launch_warm(pool, spec, Plan.data_parallel(2), on_line=on_line, on_event=s.on_event,
                                         until_step=CHANGE_AT - 1, extra_env=env, workers=s.workers))
        boot_and_first_s = time.perf_counter() - started
        # Rank 0 reads the stop object at the segment's first step (CHANGE_AT), where it stops:
        # not a step it saves anyway, so the ranks hold it for a next segment on 1 device.
        store.put_json(stop_key, {"reason": "bench: rescale to 1 device", "devices": 1,
                                  "requested_at": datetime.now(UTC).isoformat()})
        before.run(lambda s: launch_warm(pool, spec, Plan.data_parallel(2), on_line=on_line, on_event=s.on_event,
                                         extra_env=env, workers=s.workers))
        store.delete(stop_key)  # a stop request belongs to the segment it stopped
        after.run(lambda s: launch_warm(pool, spec, Plan.data_parallel(1), on_line=on_line, on_event=s.on_event,
                                        extra_env=env, workers=s.workers))
    finally:
        pool.close()
    if before.result is None or before.result.final_step != CHANGE_AT or not before.result.stopped:
        raise RuntimeError(f"the warm segment stopped at {before.result and before.result.final_step}, not {CHANGE_AT}")
    return {"downtime_s": downtime(before, after), "same_plan_downtime_s": downtime(warmup, before),
            "pool_boot_and_first_segment_s": round(boot_and_first_s, 2)}


def forkserver_state() -> dict[str, Any]:
    """The running forkservers of this process: whether any has NVIDIA's driver library mapped
    (loaded when CUDA initialises) or holds an NVIDIA device file open."""
    servers = sorted(forkserver_pids())
    alive = [pid for pid in servers if Path(f"/proc/{pid}").exists()]
    devices: list[str] = []
    for pid in alive:
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith("/dev/nvidia"):
                        devices.append(target)
    return {"forkservers": len(servers), "forkservers_alive": len(alive),
            "forkserver_cuda_initialised": any(cuda_loaded(pid) for pid in alive),
            "forkserver_nvidia_files": sorted(set(devices))}


def compare(runs: dict[str, tuple[JobSpec, list[Segment]]]) -> dict[str, Any]:
    """Every pair of runs: final state bit for bit (max |difference| where not) and losses."""
    states: dict[str, dict[str, torch.Tensor]] = {}
    errors: dict[str, str] = {}
    for name, (spec, _) in runs.items():
        try:
            states[name] = final_state(spec)
        except Exception as error:  # noqa: BLE001 - the other pairs are still compared
            errors[name] = f"{type(error).__name__}: {error}"
    pairs: dict[str, Any] = {}
    names = list(runs)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            pair: dict[str, Any] = {}
            la, lb = losses(runs[a][1]), losses(runs[b][1])
            pair["losses_equal"] = la == lb and len(la) == STEPS
            if la.keys() == lb.keys() and la:
                pair["max_loss_diff"] = max(abs(la[s] - lb[s]) for s in la)
            if a in states and b in states:
                sa, sb = states[a], states[b]
                if sa.keys() != sb.keys():
                    pair["error"] = f"tensor names differ: {sorted(sa.keys() ^ sb.keys())[:5]}"
                else:
                    diffs = {n: (sa[n].double() - sb[n].double()).abs().max().item() if sa[n].numel() else 0.0
                             for n in sa}
                    pair["bitwise"] = all(torch.equal(sa[n], sb[n]) for n in sa)
                    pair["max_abs_diff"] = max(diffs.values(), default=0.0)
                    if pair["max_abs_diff"] > 0:
                        pair["worst_tensor"] = max(diffs, key=lambda n: diffs[n])
            pairs[f"{a}-{b}"] = pair
    return {"pairs": pairs, "tensors": len(next(iter(states.values()))) if states else 0,
            **({"state_errors": errors} if errors else {})}


def main() -> None:
    args = part_args(__doc__)
    root = args.dir / "changes"
    shutil.rmtree(root, ignore_errors=True)  # a checkpoint left by an earlier run would be resumed
    root.mkdir(parents=True)
    device = args.device
    env: dict[str, str] = {}  # what each launch adds to the workers' environment
    runs: dict[str, tuple[JobSpec, list[Segment]]] = {}

    with case(PART, "relaunch") as fields, environment({FORK_WORKERS: "0"}):
        spec = job_spec("gpu-changes-relaunch", device, args.tiny, root)
        segments = [Segment(2), Segment(1)]
        runs["relaunch"] = (spec, segments)
        try:
            fields.update(relaunch(spec, env, segments))
        finally:
            fields["segments"] = [s.report() for s in segments]

    with case(PART, "warm") as fields, environment({FORK_WORKERS: "0"}):  # pool processes as on CUDA
        spec = job_spec("gpu-changes-warm", device, args.tiny, root)
        segments = [Segment(2), Segment(2), Segment(1)]
        runs["warm"] = (spec, segments)
        try:
            fields.update(warm(spec, env, segments))
        finally:
            fields["segments"] = [s.report() for s in segments]

    # This case's own forkserver, started cold by its first launch (as on a machine where none lingers).
    cold = Path(tempfile.mkdtemp(prefix="psfs-"))  # short: a Unix socket's path is at most 107 bytes
    with case(PART, "forked_relaunch") as fields, environment({FORK_WORKERS: None, FORKSERVER_DIR: str(cold)}):
        spec = job_spec("gpu-changes-forked", device, args.tiny, root)
        segments = [Segment(2), Segment(1)]
        runs["forked_relaunch"] = (spec, segments)
        try:
            fields.update(relaunch(spec, {**env, FORK_CUDA_ENV: "1"}, segments))
        finally:
            fields.update(forkserver_state(), segments=[s.report() for s in segments])
            stop_all(cold)
            shutil.rmtree(cold, ignore_errors=True)
        forked = [s.forked_ranks for s in segments]
        if forked != [s.devices for s in segments] or fields["forkserver_cuda_initialised"]:
            fields["ok"] = False
            fields["error"] = f"ranks forked by the forkserver per segment: {forked}; the forkserver " + \
                ("initialised CUDA" if fields["forkserver_cuda_initialised"] else "did not initialise CUDA")

    with case(PART, "equal") as fields:
        fields["device"] = device_name(torch.device(device))
        fields["torch"] = torch.__version__
        fields.update(compare(runs))
        if fields.get("state_errors"):  # a run without a final state: nothing was compared for it
            fields["ok"] = False
            fields["error"] = "no final state to compare for " + ", ".join(sorted(fields["state_errors"]))


if __name__ == "__main__":
    main()
