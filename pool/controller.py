"""The pool controller's bookkeeping, without Prefect: pool events in, the allocator run, what to
do out. The flow (`flows/pool.py`) observes (submissions, run states, the jobs' metrics), calls
this, and acts (starts train-job runs, sends resource events, writes stop requests); tests drive
the same code with recorded observations.

Reconciling, not commanding: each job has the devices the allocator gives it (`devices`) and the
count it was last told (`told`). A running job is told again only once it logs steps (its event
subscription is up then: Prefect does not replay events sent before it), and told again with a
newer epoch if it still runs elsewhere `RESEND_S` later (an event lost with a restarted server).
In a pool over nodes each job's count is whole nodes, and `pool.placement` names them: a job is
started on its nodes and told its nodes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from parashift.pool.allocator import PoolJob, PoolPolicy, allocate
from parashift.pool.change_cost import change_downtime_s
from parashift.pool.placement import misfit, place, whole_nodes
from parashift.pool.state import Decision, JobRecord, PoolState
from parashift.pool.step_times import Measured, Prediction, blended
from parashift.specs import JobSpec
from parashift.specs.words import counted_each
from parashift.storage import default_read_bytes_per_s

RESEND_S = 60.0
MAX_DECISIONS = 500  # kept in the state; older ones are in the flow's logs and artifacts


@dataclass(frozen=True)
class Start:
    job_id: str
    spec: JobSpec  # on its devices, in the pool


@dataclass(frozen=True)
class Resize:
    job_id: str
    devices: int
    before: int
    nodes: list[str] | None = None  # in a pool over nodes: the nodes it runs on from now


@dataclass(frozen=True)
class Preempt:
    job_id: str
    why: str


Action = Start | Resize | Preempt


class PoolBook:
    """The pool's state and the rules that change it; `clock` for tests."""

    def __init__(self, state: PoolState, policy: PoolPolicy, clock: Callable[[], float] = time.time) -> None:
        self.state, self.policy, self.clock = state, policy, clock

    # -- events ------------------------------------------------------------------------------

    def submitted(self, key: str, submitted_at: float, spec: JobSpec | str,
                  predict: Callable[[JobSpec], Prediction]) -> str:
        """A submission taken in (or refused, with why); the event's description."""
        self.state.submissions_seen.append(key)
        if isinstance(spec, str):
            return f"refused a submission: {spec}"
        known = self.state.jobs.get(spec.job_id)
        if known is not None and known.active:
            return f"refused {spec.job_id}: it is already in the pool ({known.status})"
        why = misfit(spec, self.state.nodes, self.state.devices_per_node)
        if why is not None:
            return f"refused {spec.job_id}: {why}"
        given: dict[str, object] = {"pool": self.state.pool}
        if self.state.devices_per_node is not None:
            given["devices_per_node"] = self.state.devices_per_node
        pooled = spec.model_copy(update={"resources": spec.resources.model_copy(update=given)})
        try:
            predicted = predict(pooled)
        except Exception as error:  # noqa: BLE001 - one job's spec (a model transformers cannot build) never stops the pool
            why = " ".join(str(error).split()) or type(error).__name__
            self.state.jobs[spec.job_id] = JobRecord(job_id=spec.job_id, spec=pooled, submitted_at=submitted_at,
                                                     status="failed", reason=why, finished_at=self.clock())
            return f"refused {spec.job_id}: {why}"
        record = JobRecord(job_id=spec.job_id, spec=pooled, submitted_at=submitted_at,
                           predicted_step_s=predicted.step_s, state_bytes=predicted.state_bytes)
        self.state.jobs[spec.job_id] = record
        if not predicted.step_s:
            record.status, record.reason, record.finished_at = "failed", "no plan of it fits this pool", self.clock()
            return f"refused {spec.job_id}: no plan of it fits a device count of this pool"
        return f"{spec.job_id} submitted"

    def nodes_seen(self, online: Iterable[str]) -> str | None:
        """Which of a pool's nodes have a worker online now; the event when that changed (the
        devices of a node that left are not given out until it is back)."""
        if self.state.nodes is None:
            return None
        up = set(online)
        down = [node for node in self.state.nodes if node not in up]
        left = [node for node in down if node not in self.state.nodes_down]
        back = [node for node in self.state.nodes_down if node not in down and node in self.state.nodes]
        self.state.nodes_down = down
        return "; ".join([f"node {node} left" for node in left] + [f"node {node} joined" for node in back]) or None

    def ended(self, job_id: str, status: str, reason: str | None = None) -> str:
        """A run of the job ended: finished, failed for good, or stopped (preempted: it waits
        again and resumes from its checkpoint when it is given devices)."""
        job = self.state.jobs[job_id]
        job.flow_run_id, job.told, job.nodes, job.told_nodes = None, 0, None, None
        if status == "stopped":
            job.status = "waiting"
            return f"{job_id} stopped (preempted); it waits"
        job.status, job.reason, job.finished_at, job.devices = status, reason, self.clock(), 0  # type: ignore[assignment]
        if status == "finished":  # every step trained, whatever its metrics said at the last tick
            job.steps_done = job.spec.training.steps
        return f"{job_id} {status}" + (f": {reason}" if reason else "")

    def observed(self, job_id: str, seen: Measured) -> str | None:
        """What the job's metrics say; an event when it measured a device count for the first time
        (its speed there is known now, and may change what it should have)."""
        job = self.state.jobs[job_id]
        new = sorted(set(seen.step_s) - set(job.measured_step_s))
        job.measured_step_s = dict(seen.step_s)
        job.steps_done = max(job.steps_done, seen.last_step)
        if seen.change_cost_s is not None:
            job.change_cost_s = seen.change_cost_s
        return f"{job_id} measured on {counted_each(new, 'device')}" if new else None

    # -- decisions ---------------------------------------------------------------------------

    def pool_job(self, job: JobRecord) -> PoolJob:
        res = job.spec.resources
        step_s = blended(job.predicted_step_s, job.measured_step_s)
        warm = res.warm_workers and self.state.nodes is None  # jobs across nodes relaunch at a change
        least, requested = res.min_devices or 1, res.devices
        if self.state.devices_per_node is not None:  # a pool over nodes gives whole nodes
            per_node = self.state.devices_per_node
            least, requested = (whole_nodes(n, per_node) * per_node for n in (least, requested))
        cost = job.change_cost_s
        if cost is None:  # none measured yet: the cost model's, at the size it runs at (as the simulator's)
            size = job.devices or least
            cost = change_downtime_s(job.state_bytes or 0, size, size, warm=warm,
                                     read_bytes_per_s=default_read_bytes_per_s(job.spec.storage.url))
        return PoolJob(job.job_id, step_s, max(job.spec.training.steps - job.steps_done, 1), job.submitted_at,
                       priority=res.priority, min_devices=least, max_devices=res.max_devices,
                       devices=job.devices if job.status == "running" else 0, change_cost_s=cost,
                       requested=requested)

    def allocate(self, events: list[str]) -> Decision:
        """Run the allocator over the active jobs; record and return the decision."""
        now = self.clock()
        jobs = self.state.active()
        up = [node for node in self.state.nodes or [] if node not in self.state.nodes_down]
        per_node = self.state.devices_per_node
        capacity = self.state.devices if self.state.nodes is None or per_node is None else len(up) * per_node
        allocation = allocate([self.pool_job(job) for job in jobs], capacity, now, self.policy)
        for job in jobs:
            job.devices = allocation.devices[job.job_id]
        placed: dict[str, list[str]] = {}
        if self.state.nodes is not None and per_node is not None:
            placed = place(allocation.devices, {job.job_id: job.nodes or [] for job in jobs}, up, per_node)
            for job in jobs:
                job.nodes = placed.get(job.job_id)
        decision = Decision(at=now, event="; ".join(events), devices=dict(allocation.devices),
                            reasons={d.job_id: d.why for d in allocation.decisions}, nodes=placed)
        self.state.decisions = [*self.state.decisions[-(MAX_DECISIONS - 1):], decision]
        return decision

    def actions(self, seen: dict[str, Measured]) -> list[Action]:
        """What to do now so that every job runs on what it was given: starts, resource events,
        stop requests. Marks them done in the state (the caller acts before it saves)."""
        now, out = self.clock(), []
        for job in self.state.active():
            if job.devices and job.flow_run_id is None:  # to start (or started by a controller that died)
                out.append(Start(job.job_id, self.spec_on(job)))
                job.status, job.told, job.told_nodes, job.told_at = "running", job.devices, job.nodes, now
                job.started_at = job.started_at or now
            elif job.status == "running" and job.devices == 0 and (job.told or now - job.told_at > RESEND_S):
                # again if it still runs: a stop request written between two segments is the next one's to drop
                out.append(Preempt(job.job_id, "the pool gives its devices to jobs ranked before it"))
                job.told, job.told_at = 0, now
            elif job.status == "running" and job.devices and self._should_tell(job, seen.get(job.job_id), now):
                out.append(Resize(job.job_id, job.devices, job.told, job.nodes))
                job.changes += job.devices != job.told or job.nodes != job.told_nodes
                job.told, job.told_nodes, job.told_at = job.devices, job.nodes, now
        return out

    @staticmethod
    def spec_on(job: JobRecord) -> JobSpec:
        """The job's spec on what it is given: its devices, or its nodes in a pool over nodes."""
        if job.nodes is None:
            return job.spec.on_devices(job.devices)
        return job.spec.on_nodes(job.nodes)

    @staticmethod
    def _should_tell(job: JobRecord, seen: Measured | None, now: float) -> bool:
        if seen is None or seen.devices_now is None:
            return False  # not stepping yet: an event now could arrive before it listens
        if job.devices != job.told or job.nodes != job.told_nodes:
            return True
        if job.told_nodes is not None and seen.devices_now < job.told:
            # A job across nodes on fewer devices than told lost a node and re-planned by itself
            # (docs/nodes.md): its old nodes, told again, may include the lost one. It is told
            # its nodes at the pool's next decision (a node that left is one, once Prefect
            # marks its worker offline).
            return False
        return seen.devices_now != job.told and now - job.told_at > RESEND_S

    def idle(self) -> bool:
        return not self.state.active()
