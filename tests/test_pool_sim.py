"""The pool simulator (bench/pool_sim.py) on a small seeded trace: every job of every system
finishes, its step times are the cost model's, and the pool never gives out more devices than it has."""

from __future__ import annotations

import pytest
from parashift.bench import pool_sim
from parashift.pool.allocator import PoolPolicy


@pytest.mark.parametrize("system", ["static", "pool-parashift", "pool-stop-restart"])
def test_every_job_finishes_and_the_pool_is_never_exceeded(system: str, monkeypatch: pytest.MonkeyPatch) -> None:
    gpus, trace = 64, pool_sim.make_trace(60, 64, seed=3)
    seen: list[int] = []
    fifo, pooled = pool_sim._fifo, pool_sim._pooled

    def check_fifo(active: list[pool_sim.SimJob], n: int) -> None:
        fifo(active, n)
        seen.append(sum(j.devices for j in active))

    def check_pooled(active: list[pool_sim.SimJob], n: int, *rest: object) -> None:
        pooled(active, n, *rest)  # type: ignore[arg-type]
        seen.append(sum(j.devices for j in active))

    monkeypatch.setattr(pool_sim, "_fifo", check_fifo)
    monkeypatch.setattr(pool_sim, "_pooled", check_pooled)
    result = pool_sim.simulate(trace, gpus, system, PoolPolicy())
    assert result["jobs"] == len(trace) and result["mean_jct_s"] > 0
    assert seen and max(seen) <= gpus
    if system != "static":
        assert result["changes"] <= 10 * len(trace)  # hysteresis: no thrashing


def test_step_times_come_from_the_cost_model_and_fall_with_devices() -> None:
    curve, state_bytes = pool_sim.archetype_curve("medium")
    assert curve[8] < curve[1] and state_bytes > 1e9
    large, _ = pool_sim.archetype_curve("large")
    assert min(large) > 1  # the 8B shape does not fit one 80 GiB device
