"""The pool's allocator (`pool.allocator`) over random pools and jobs: it never gives out more
than the pool, gives minimums in rank order (priority, raised by waiting; then submission),
respects each job's min, max and plan counts, finds the exact optimum (against brute force),
and makes no change whose gain over the horizon is below its cost."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st
from parashift.pool.allocator import PoolJob, PoolPolicy, admit, allocate, horizon_value, rank

POLICY = PoolPolicy(horizon_s=600.0, aging_s=900.0)


@st.composite
def jobs_and_pool(draw: st.DrawFn, max_jobs: int = 5, max_pool: int = 12) -> tuple[list[PoolJob], int]:
    pool = draw(st.integers(1, max_pool))
    jobs = []
    for i in range(draw(st.integers(0, max_jobs))):
        counts = sorted(draw(st.sets(st.integers(1, max_pool + 2), min_size=1, max_size=5)))
        base = draw(st.floats(0.1, 10.0))
        # step time falls with devices, each count at most linearly faster, sometimes not at all
        step_s, t = {}, base
        for n in counts:
            t = max(base / n, t * draw(st.floats(0.3, 1.1)))
            step_s[n] = t
        low = draw(st.sampled_from(counts))
        high = draw(st.one_of(st.none(), st.sampled_from([n for n in counts if n >= low])))
        holds = draw(st.sampled_from([0, *[n for n in counts if n >= low and (high is None or n <= high)]]))
        jobs.append(PoolJob(f"job{i}", step_s, draw(st.integers(1, 10_000)), submitted_at=draw(st.floats(0, 1000)),
                            priority=draw(st.integers(0, 3)), min_devices=low, max_devices=high, devices=holds,
                            change_cost_s=draw(st.floats(0.0, 120.0))))
    return jobs, pool


@settings(max_examples=300, deadline=None)
@given(jobs_and_pool())
def test_never_more_than_the_pool_and_each_job_within_its_bounds(case: tuple[list[PoolJob], int]) -> None:
    jobs, pool = case
    out = allocate(jobs, pool, now=1000.0, policy=POLICY)
    assert set(out.devices) == {j.job_id for j in jobs}
    assert sum(out.devices.values()) <= pool
    for job in jobs:
        n = out.devices[job.job_id]
        assert n == 0 or (n in job.step_s and job.min_devices <= n <= (job.max_devices or pool))


@settings(max_examples=300, deadline=None)
@given(jobs_and_pool())
def test_a_waiting_job_could_not_run_with_every_device_above_others_minimums(case: tuple[list[PoolJob], int]) -> None:
    """No starvation by the rich: a job waits only where the minimums of the jobs ranked before
    it leave too little, and so no device others hold above their minimums could serve it."""
    jobs, pool = case
    now = 1000.0
    out = allocate(jobs, pool, now=now, policy=POLICY)
    order = rank(jobs, now, POLICY)
    for i, job in enumerate(order):
        if out.devices[job.job_id] or not job.counts(pool):
            continue
        before = sum(min(j.counts(pool)) for j in order[:i] if out.devices[j.job_id])
        assert min(job.counts(pool)) > pool - before, (job.job_id, before)


def test_waiting_raises_a_jobs_rank_until_it_outranks_everyone() -> None:
    step = {1: 1.0, 2: 0.5, 4: 0.25}
    big = PoolJob("big", step, 100, submitted_at=0.0, priority=3, min_devices=4, devices=4)
    small = PoolJob("small", step, 100, submitted_at=10.0, priority=0, min_devices=4)
    assert allocate([big, small], 4, now=100.0, policy=POLICY).devices == {"big": 4, "small": 0}
    # after (3 - 0 + 1) agings the waiting job outranks the running one, which gives way
    later = 10.0 + 4 * POLICY.aging_s
    assert allocate([big, small], 4, now=later, policy=POLICY).devices == {"big": 0, "small": 4}


def brute_force(jobs: list[PoolJob], pool: int) -> float:
    admitted, _ = admit(jobs, pool, 1000.0, POLICY)
    best = 0.0 if not admitted else float("-inf")
    for combo in itertools.product(*[j.counts(pool) for j in admitted]):
        if sum(combo) <= pool:
            best = max(best, sum(horizon_value(j, n, POLICY) for j, n in zip(admitted, combo, strict=True)))
    return best


@settings(max_examples=200, deadline=None)
@given(jobs_and_pool(max_jobs=4, max_pool=10))
def test_the_dynamic_program_finds_the_brute_force_optimum(case: tuple[list[PoolJob], int]) -> None:
    jobs, pool = case
    out = allocate(jobs, pool, now=1000.0, policy=POLICY)
    assert abs(out.value - brute_force(jobs, pool)) <= 1e-9 * max(1.0, abs(out.value))
    running = [j for j in jobs if out.devices[j.job_id]]
    assert abs(out.value - sum(horizon_value(j, out.devices[j.job_id], POLICY) for j in running)) <= 1e-6 * max(
        1.0, out.value)


def progress(job: PoolJob, n: int, changed: bool) -> float:
    """Priority-weighted progress over the horizon, in seconds of the job at its smallest count;
    a change's downtime (at least a millisecond) comes off the horizon; a job that finishes
    within it gains, for each second sooner, its mean rate over the horizon."""
    downtime = max(job.change_cost_s, 1e-3) if changed else 0.0
    finish = downtime + job.remaining_steps * job.step_s[n]
    weight = 2.0 ** job.priority * job.step_s[min(job.step_s)]
    if finish <= POLICY.horizon_s:
        return weight * job.remaining_steps * (2.0 - finish / POLICY.horizon_s)
    return weight * max(POLICY.horizon_s - downtime, 0.0) / job.step_s[n]


@settings(max_examples=300, deadline=None)
@given(jobs_and_pool())
def test_no_change_gains_less_than_it_costs(case: tuple[list[PoolJob], int]) -> None:
    """Where the running jobs could all keep what they hold, the allocator changes them only if
    the changes' gain in progress over the horizon exceeds what their downtime costs."""
    jobs, pool = case
    out = allocate(jobs, pool, now=1000.0, policy=POLICY)
    admitted, _ = admit(jobs, pool, 1000.0, POLICY)
    keep = {j.job_id: j.devices if j.devices in j.counts(pool) else min(j.counts(pool)) for j in admitted}
    if sum(keep.values()) > pool or not any(out.devices[j] != keep[j] for j in keep):
        return
    # a job holding more than the pool has now must change anyway: its downtime counts either way
    kept = sum(progress(j, keep[j.job_id], bool(j.devices) and keep[j.job_id] != j.devices) for j in admitted)
    made = sum(progress(j, out.devices[j.job_id], bool(j.devices) and out.devices[j.job_id] != j.devices)
               for j in admitted)
    assert made > kept, (made, kept, out.devices, keep)


def test_priority_takes_the_spare_devices() -> None:
    step = {1: 1.0, 2: 0.5, 4: 0.25}
    low = PoolJob("low", step, 10_000, submitted_at=0.0, priority=0)
    high = PoolJob("high", step, 10_000, submitted_at=1.0, priority=2)
    assert allocate([low, high], 5).devices == {"high": 4, "low": 1}
    # a job that finishes within the horizon on fewer devices leaves the rest to the other
    short = PoolJob("short", step, 100, submitted_at=1.0, priority=2)
    assert allocate([low, short], 5).devices == {"short": 1, "low": 4}


def test_a_job_that_does_not_scale_leaves_devices_to_one_that_does() -> None:
    flat = PoolJob("flat", {1: 1.0, 2: 0.99, 4: 0.98}, 10_000, submitted_at=0.0)
    linear = PoolJob("linear", {1: 1.0, 2: 0.5, 4: 0.25}, 10_000, submitted_at=1.0)
    assert allocate([flat, linear], 5).devices == {"flat": 1, "linear": 4}
    explained = {d.job_id: d.why for d in allocate([flat, linear], 5).decisions}
    assert explained["linear"].startswith("starts on 4")


def test_static_fifo_gives_each_job_its_request_in_order_without_backfill() -> None:
    step = {1: 1.0, 2: 0.5, 3: 0.4, 4: 0.3}
    fifo = PoolPolicy(mode="static-fifo")
    first = PoolJob("first", step, 100, submitted_at=0.0, requested=3, devices=3)
    big = PoolJob("big", step, 100, submitted_at=1.0, requested=2)
    small = PoolJob("small", step, 100, submitted_at=2.0, requested=1)
    # one device is free: `small` fits, but `big` is ahead of it and does not
    assert allocate([first, big, small], 4, policy=fifo).devices == {"first": 3, "big": 0, "small": 0}
    assert allocate([big, small], 4, policy=fifo).devices == {"big": 2, "small": 1}
