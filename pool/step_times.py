"""A pool job's seconds per step at each device count: the planner's prediction first, replaced
by what the job measures as it runs.

- **Predicted** (`tasks.pool_jobs.predicted`, beside the planner's task): the planner's
  pick for each count. Computed once per job and kept in the pool's state.
- **Measured** (`measured`): the job's own TensorBoard scalars in its storage
  (`jobs/{job}/metrics/`, trainer/scalars.py): `step_s` and `devices` per logged step, read with
  TensorBoard's own event reader. Each event file is one segment; the downtime of a change is the
  wall time between one segment's last logged step and the next one's first, less a step.
- **Blended** (`blended`): measured counts as measured; a count not yet measured is the
  prediction scaled by measured ÷ predicted at the nearest measured count, so a cost model that
  is off by a constant (a loaded host) does not bias the pool against the measured counts.
"""

from __future__ import annotations

import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from parashift.pool.placement import pool_counts
from parashift.specs import JobSpec
from parashift.storage import ObjectStore
from parashift.trainer.events import FILLED_SUFFIX


def counts_for(spec: JobSpec, pool_devices: int, devices_per_node: int | None = None) -> list[int]:
    """The device counts a job may run on in a pool: at least one sequence per device, within
    its min and max; in a pool over nodes (`devices_per_node`), whole nodes."""
    low, high = spec.device_bounds()
    counts = list(range(low, min(high, pool_devices) + 1))
    return counts if devices_per_node is None else pool_counts(counts, devices_per_node)


@dataclass(frozen=True)
class Prediction:
    """What the planner says of a job before it runs: its seconds per step at each device count
    a plan of it fits (`tasks.pool_jobs.predicted`), and the training state a change moves
    (`pool.change_cost`; None: not known, a change costs its fixed part)."""

    step_s: dict[int, float]
    state_bytes: int | None = None


@dataclass
class Measured:
    """What a job's metrics say so far."""

    step_s: dict[int, float] = field(default_factory=dict)  # median per device count
    change_cost_s: float | None = None  # median downtime of its changes of count
    last_step: int = 0
    devices_now: int | None = None  # the count of its newest logged step


def measured(store: ObjectStore, job_id: str) -> Measured:
    """Read the job's TensorBoard event files from its storage (copied to a temporary folder:
    the reader wants local files)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # Not a fill of steps a killed rank 0 lost: its wall times are the fill's, not the steps'.
    keys = sorted(k for k in store.list(f"jobs/{job_id}/metrics")
                  if "tfevents" in k.rsplit("/", 1)[-1] and not k.endswith(FILLED_SUFFIX))
    segments: list[list[tuple[int, float, float, int]]] = []  # (step, wall, step_s, devices)
    with tempfile.TemporaryDirectory(prefix="parashift-pool-metrics-") as folder:
        for key in keys:
            path = Path(folder) / key.rsplit("/", 1)[-1]
            path.write_bytes(store.get(key))
            events = EventAccumulator(str(path), size_guidance={"scalars": 0})
            events.Reload()
            tags = events.Tags()["scalars"]
            if "step_s" not in tags or "devices" not in tags:
                continue
            devices = {e.step: int(e.value) for e in events.Scalars("devices")}
            rows = [(e.step, e.wall_time, e.value, devices.get(e.step, 0)) for e in events.Scalars("step_s")]
            if rows:
                segments.append(sorted(rows))
    segments.sort(key=lambda rows: rows[0][1])  # by wall time: a resumed segment may repeat steps
    out = Measured()
    by_count: dict[int, list[float]] = {}
    for rows in segments:
        # A segment's first step pays its warm-up (compilation, the first collectives): left out
        # unless it is all there is.
        for _, _, step_s, n in rows[1:] or rows:
            by_count.setdefault(n, []).append(step_s)
    out.step_s = {n: statistics.median(values) for n, values in by_count.items() if n > 0}
    downtimes = [after[0][1] - before[-1][1] - after[0][2]
                 for before, after in zip(segments, segments[1:], strict=False) if before[-1][3] != after[0][3]]
    if downtimes:
        out.change_cost_s = max(statistics.median(downtimes), 0.0)
    if segments:
        newest = max(segments, key=lambda rows: rows[-1][1])
        out.last_step, out.devices_now = newest[-1][0], newest[-1][3]
    return out


def blended(predicted: dict[int, float], measured_step_s: dict[int, float]) -> dict[int, float]:
    """Measured counts as measured; the others predicted, scaled by the nearest measured count's
    measured ÷ predicted."""
    if not measured_step_s:
        return dict(predicted)
    out = {}
    for n, value in predicted.items():
        if n in measured_step_s:
            out[n] = measured_step_s[n]
            continue
        near = min((m for m in measured_step_s if m in predicted), key=lambda m: (abs(m - n), m), default=None)
        out[n] = value * (measured_step_s[near] / predicted[near]) if near is not None else value
    return out
