"""How many devices each job of a shared pool gets: a pure function of the jobs and the pool,
run on every pool event (a job submitted, finished or failed; a node joined or left; a device
failed). No Prefect, no processes: the controller, the simulator and the tests call the same code.

What it promises (docs/pool.md):

- **Never more than the pool.** The devices given out sum to at most `devices`.
- **Minimums first, in rank order.** Jobs are ranked by priority, raised by one for every
  `aging_s` a job has waited, then by submission. Walking that order, each job gets its
  `min_devices` if they are still free, else it waits (a smaller job further down may run
  meanwhile: it takes nothing the waiting job could have had). So a waiting job could not run
  even with every device the others hold above their minimums, and a job of priority p waits at
  most (MAX_PRIORITY - p + 1) x aging_s before it outranks every other job (then lower-ranked
  jobs give up their devices at that event).
- **The rest for throughput.** The devices left go where they add the most priority-weighted
  progress over a horizon (steps a job does in it at n devices, counted in seconds of the job
  at its smallest count, so jobs of any size compare; weight 2 ** priority; a job that would
  finish within the horizon gains its mean rate for each second sooner), within each job's `max_devices`
  and the device counts its plans exist for: an exact dynamic program over jobs and devices (a
  multiple-choice knapsack).
- **No change that does not pay.** A running job whose device count changes loses its
  change's downtime from the horizon (its measured downtime, or the cost model's before one is
  measured; never less than MIN_CHANGE_COST_S). The optimum over these values changes nothing
  whose gain would not exceed its cost, and keeps what runs where values tie.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from parashift.specs.words import counted

MAX_PRIORITY = 9
# The least a change costs (a stop at a step boundary): equal values keep what runs.
MIN_CHANGE_COST_S = 1e-3
TIE_MARGIN = 1e-9  # relative: where a change's value only ties, what runs is kept


@dataclass(frozen=True)
class PoolPolicy:
    horizon_s: float = 600.0  # how far ahead a change's gain is counted against its cost
    aging_s: float = 900.0  # a waiting job's rank rises by one priority per this many seconds
    # "throughput": the allocator above; "static-fifo": the baseline clusters run (each job its
    # requested devices for its whole run, in submission order, no backfill), to compare against
    mode: str = "throughput"


@dataclass(frozen=True)
class PoolJob:
    """A job as the allocator sees it. `step_s`: seconds per step at each device count its plans
    exist for (the planner's prediction, replaced by measured step times as they arrive)."""

    job_id: str
    step_s: dict[int, float]
    remaining_steps: int
    submitted_at: float
    priority: int = 0
    min_devices: int = 1
    max_devices: int | None = None
    devices: int = 0  # what it holds now (0: waiting, or not started)
    change_cost_s: float = 0.0  # downtime of one change of device count
    requested: int | None = None  # what it asked for (static FIFO gives it exactly that)

    def counts(self, pool: int) -> list[int]:
        """The device counts this job may run at in a pool of `pool`."""
        top = min(self.max_devices or pool, pool)
        return sorted(n for n in self.step_s if self.min_devices <= n <= top)

    def rank_priority(self, now: float, policy: PoolPolicy) -> int:
        waited = 0 if self.devices else max(now - self.submitted_at, 0.0)
        return min(self.priority, MAX_PRIORITY) + int(waited // policy.aging_s)

    def speedup(self, n: int) -> float:
        """Rate at n devices over rate at its smallest count."""
        base = self.step_s[min(self.step_s)]
        return base / self.step_s[n]


@dataclass
class JobDecision:
    job_id: str
    before: int
    after: int
    step_s_before: float | None
    step_s_after: float | None
    change_cost_s: float
    why: str


@dataclass
class Allocation:
    devices: dict[str, int]
    decisions: list[JobDecision] = field(default_factory=list)
    value: float = 0.0  # the objective over the horizon (priority-weighted speedup-seconds)

    def changed(self) -> list[JobDecision]:
        return [d for d in self.decisions if d.before != d.after]


def rank(jobs: list[PoolJob], now: float, policy: PoolPolicy) -> list[PoolJob]:
    return sorted(jobs, key=lambda j: (-j.rank_priority(now, policy), j.submitted_at, j.job_id))


def admit(jobs: list[PoolJob], devices: int, now: float, policy: PoolPolicy) -> tuple[list[PoolJob], list[PoolJob]]:
    """Minimums in rank order: (admitted, waiting)."""
    admitted, waiting, free = [], [], devices
    for job in rank(jobs, now, policy):
        counts = job.counts(devices)
        if counts and counts[0] <= free:
            admitted.append(job)
            free -= counts[0]
        else:
            waiting.append(job)
    return admitted, waiting


def horizon_value(job: PoolJob, n: int, policy: PoolPolicy) -> float:
    """Priority-weighted progress at n devices within the horizon, in seconds of the job at its
    smallest count (steps done x that count's step time): the job's speedup over the horizon.
    A job that would finish within it has done all its steps, and gains for each second sooner
    its mean rate over the horizon (finishing sooner frees its devices and ends its wait; so
    spare devices never sit idle beside a job they would speed up, yet a job near its end gains
    far less from a device than one with the horizon ahead of it). A running job whose count
    changes loses its change's downtime from the horizon, and a change is never free."""
    changed = bool(job.devices) and n != job.devices
    downtime = max(job.change_cost_s, MIN_CHANGE_COST_S) if changed else 0.0
    weight = (2.0 ** min(job.priority, MAX_PRIORITY)) * job.step_s[min(job.step_s)]
    finish = downtime + job.remaining_steps * job.step_s[n]
    if finish <= policy.horizon_s:  # all its steps, and each second sooner its devices are free
        value = weight * job.remaining_steps * (2.0 - finish / policy.horizon_s)
    else:
        value = weight * max(policy.horizon_s - downtime, 0.0) / job.step_s[n]
    return value * (1.0 - TIE_MARGIN) if changed else value  # a change that gains nothing is not made


def allocate(jobs: list[PoolJob], devices: int, now: float = 0.0, policy: PoolPolicy | None = None) -> Allocation:
    """Each job's device count (0: it waits) for a pool of `devices`."""
    policy = policy or PoolPolicy()
    if policy.mode == "static-fifo":
        return static_fifo(jobs, devices)
    admitted, waiting = admit(jobs, devices, now, policy)
    choices = [job.counts(devices) for job in admitted]
    values = [np.array([horizon_value(job, n, policy) for n in counts]) for job, counts in zip(admitted, choices, strict=True)]
    picks, value = _best_choices(choices, values, devices)
    out = {job.job_id: counts[k] for job, counts, k in zip(admitted, choices, picks, strict=True)}
    out.update({job.job_id: 0 for job in waiting})
    allocation = Allocation(out, value=value)
    for job in jobs:
        allocation.decisions.append(_explain(job, out[job.job_id], job in waiting))
    return allocation


def static_fifo(jobs: list[PoolJob], devices: int) -> Allocation:
    """The baseline: what runs keeps what it has; waiting jobs start in submission order on
    exactly their requested devices (at most the pool) while the next one fits, and a job that
    does not fit holds up every job behind it (no backfill)."""
    out = {job.job_id: job.devices for job in jobs}
    free = devices - sum(out.values())
    blocked = False
    for job in sorted((j for j in jobs if not j.devices), key=lambda j: (j.submitted_at, j.job_id)):
        want = min(job.requested or job.min_devices, devices)
        if not blocked and want <= free:
            out[job.job_id], free = want, free - want
        else:
            blocked = True
    decisions = [JobDecision(j.job_id, j.devices, out[j.job_id], j.step_s.get(j.devices), j.step_s.get(out[j.job_id]),
                             0.0, "static FIFO: " + ("keeps its devices" if j.devices else
                                                     f"starts on its {counted(out[j.job_id], 'requested device')}"
                                                     if out[j.job_id] else "waits its turn"))
                 for j in jobs]
    return Allocation(out, decisions)


def _best_choices(choices: list[list[int]], values: list[np.ndarray], devices: int) -> tuple[list[int], float]:
    """The multiple-choice knapsack, exactly: one count per job (index into its choices), their
    sum at most `devices`, the total value largest. A dynamic program over jobs, one array of
    best totals by devices used beyond the jobs' smallest counts (vectorised over devices)."""
    if not choices:
        return [], 0.0
    spare = devices - sum(counts[0] for counts in choices)
    if spare < 0:
        raise ValueError("the admitted jobs' minimums do not fit the pool")  # admit() prevents this
    best = np.full(spare + 1, -np.inf)
    best[0] = 0.0
    taken = []
    for counts, value in zip(choices, values, strict=True):
        new = np.full(spare + 1, -np.inf)
        pick = np.zeros(spare + 1, dtype=np.int16)
        for k, n in enumerate(counts):
            extra = n - counts[0]
            if extra > spare:
                break
            candidate = best[: spare + 1 - extra] + value[k]
            better = candidate > new[extra:]  # strictly: on a tie the smaller count stays
            np.copyto(new[extra:], candidate, where=better)
            np.copyto(pick[extra:], k, where=better)
        best = new
        taken.append(pick)
    used = int(np.argmax(best))
    total = float(best[used])
    picks = []
    for counts, pick in zip(reversed(choices), reversed(taken), strict=True):
        k = int(pick[used])
        picks.append(k)
        used -= counts[k] - counts[0]
    return picks[::-1], total


def _explain(job: PoolJob, after: int, waits: bool) -> JobDecision:
    before = job.devices
    if waits:
        why = (f"waits: its minimum of {counted(job.min_devices, 'device')} is not free after the jobs ranked before it"
               if job.counts(10**9) else "waits: no plan of it fits this pool")
    elif before == after:
        why = "keeps its devices: no change gains more than it costs over the horizon"
    elif before == 0:
        why = f"starts on {counted(after, 'device')}"
    else:
        gain = job.step_s[before] / job.step_s[after] if before in job.step_s else float("nan")
        why = (f"{before} -> {after} devices: step time x{1 / gain:.3g}; the pool gains more over the horizon "
               f"than the {job.change_cost_s:.3g} s change costs")
    return JobDecision(job.job_id, before, after, job.step_s.get(before), job.step_s.get(after),
                       job.change_cost_s if before and after != before else 0.0, why)
