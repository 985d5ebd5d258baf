"""What a change of a job's device count costs before the job has measured one of its own: a fixed
part measured on workers, plus moving the job's training state at its new size. The controller
(`pool.controller`) and the simulator (`bench/pool_sim.py`) both price changes here, so the
simulator replays what the live pool weighs.

A fixed cost alone (2 s) priced a Llama 3 8B job's first change like a toy's: its 96 GB of
weights and Adam moments take 12 s to read onto 8 devices at a local disk's rate (1 GB/s each),
2 minutes from an object store. A pool would then move a large job for a gain its change eats.
"""

from __future__ import annotations

# A planned change on warm workers: 1.2-1.9 s measured on CPU workers (BENCHMARKS.md,
# bench.trace). A stop and restart: bench/dcp_restart.py's median downtime, measured beside it.
WARM_CHANGE_S = 1.5
RESTART_S = 8.23
# What a change moves per parameter: fp32 weights and Adam's two moments (gradients are rebuilt).
STATE_BYTES_PER_PARAM = 12


def state_bytes(n_params: int) -> int:
    """The training state a change moves for a model of `n_params` parameters."""
    return STATE_BYTES_PER_PARAM * n_params


def change_downtime_s(state: float, before: int, after: int, *, warm: bool, read_bytes_per_s: float) -> float:
    """Seconds a job with `state` bytes of training state stops for when it moves from `before`
    devices (0: it was not running) to `after`: each new device reads its share of the state.
    Warm workers keep their processes and the state they hold; otherwise the job saves its state
    at the old size, restarts, and loads it at the new one."""
    if read_bytes_per_s <= 0:
        raise ValueError(f"read bandwidth must be positive, got {read_bytes_per_s}")
    load = state / (max(after, 1) * read_bytes_per_s)
    if warm:
        return WARM_CHANGE_S + load
    save = state / (before * read_bytes_per_s) if before else 0.0
    return RESTART_S + save + load
