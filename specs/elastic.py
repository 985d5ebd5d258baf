"""The elastic policy: what a running job does when its resources change, in one place.

Given the job's state (devices, nodes, the last committed step, its segments so far, the highest
epoch it has decided on) and a change (a resource event, or the end of a segment: finished,
stopped, failed, a node gone), `decide` returns what to do: `Ignore` it (and why), `Stop`,
`Replan` onto N devices on these nodes, or `Fail` (and why). The flow asks and acts
(`flows/train.py`); the tasks around it hear changes, launch workers and record what happened,
and hold no rule of their own. docs/elastic.md says the same rules in prose:

- The highest epoch wins: an event whose epoch is not above every epoch the job has seen (or
  decided on) is ignored; so is an event sent to another job (`admit`).
- A change to the devices and nodes the job already runs on does nothing.
- A job on one node takes a device count; a job across nodes takes a node list as it is, and a
  device count as the first nodes that hold it (whole nodes only). No change may give a device
  less than one sequence per step (devices <= training.global_batch). What breaks a rule is
  ignored, with the rule in the reason.
- A failed segment (a worker died or hung) resumes from the last committed checkpoint on one
  device fewer (at least one); across nodes, on the nodes that did not leave (`node-left`).
  Such a change is recorded and emitted like an event (`Replan.announce`). Two failures in a
  row that commit no new step fail the job, and so does every node leaving.
- A node of the spec whose worker comes back is taken in again (`rejoined_nodes`, `node-joined`).
- A segment stopped for a change re-plans for the newest one; a segment that reached the spec's
  next scripted change (`elasticity`) re-plans for it; one that reached the last step, or was
  asked to stop, stops the job; one whose workers reported an error no retry can fix fails it.
- How a segment ended is read from its workers' reports and exit (`segment_outcome`).

Why in `specs`: the rules read nothing but the job's spec and small records, and they are the
meaning of the spec's `resources` and `elasticity` while the job runs, as `specs.plan` is the
contract between planner and trainer. The reason vocabulary they share with the spec's
`elasticity[].reason` lives in `specs.models`, so a room of its own would import `specs` while
`specs` imports it. `specs` imports neither Prefect nor torch (tests/test_imports.py), so the
flow, the tasks, the CLI and plain unit tests all use this one module.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal, Protocol

from parashift.specs.models import REASONS, JobSpec, Reason, ResourceChange
from parashift.specs.words import counted
from pydantic import BaseModel, Field, model_validator

# Reasons for a change that nobody asked for: the job lost what it ran on (a warning in its log);
# the others are the job working as meant (a scale, a pool's share, a node added).
UNPLANNED: frozenset[Reason] = frozenset({"preemption", "failure", "node-left"})

# How a segment (one launch of the workers) ended.
Outcome = Literal["finished", "stopped", "rescaled", "failed", "fatal"]


class ResourceEvent(BaseModel):
    """A resource change: the devices, or the nodes, the job should run on from now (the
    payload of a `parashift.resources.changed` event, and what the job records of it)."""

    devices: int | None = Field(None, ge=1, le=65536, description="devices (worker processes) the job should use")
    nodes: list[str] | None = Field(
        None, min_length=1, max_length=4096,
        description="a job across nodes: the nodes it should use (each with the spec's devices per node)")
    epoch: int = Field(ge=0, description="ordering: a change with a higher epoch replaces any lower one")
    reason: Reason = Field("scale", description="why: " + ", ".join(REASONS))

    @model_validator(mode="after")
    def _says_what(self) -> ResourceEvent:
        if self.devices is None and self.nodes is None:
            raise ValueError("a resource change names devices or nodes")
        return self

    def differs(self, devices: int, nodes: list[str] | None) -> bool:
        """Whether this change asks for something else than `devices` on `nodes` (None: one
        node; node lists matter only to jobs across nodes)."""
        if self.nodes is not None and nodes is not None and list(self.nodes) != list(nodes):
            return True
        return self.devices is not None and self.devices != devices

    def describe(self) -> str:
        return f"nodes {','.join(self.nodes)}" if self.nodes is not None else counted(self.devices, "device")


class Segment(Protocol):
    """What the policy reads of a segment's record (`tasks.records.SegmentResult`)."""

    @property
    def devices(self) -> int: ...
    @property
    def start_step(self) -> int: ...
    @property
    def final_step(self) -> int: ...
    @property
    def outcome(self) -> Outcome: ...
    @property
    def reason(self) -> str | None: ...
    @property
    def nodes(self) -> list[str] | None: ...
    @property
    def left_nodes(self) -> list[str]: ...


# Decisions


@dataclass(frozen=True)
class Ignore:
    """Nothing changes: the job goes on as it runs (`why` says what was ignored and why)."""

    why: str
    epoch: int | None = None  # the event decided on: it is not heard again


@dataclass(frozen=True)
class Stop:
    """The job ends here, completed (finished, or asked to stop with a committed checkpoint)."""

    why: str


@dataclass(frozen=True)
class Replan:
    """Plan for `devices` on `nodes` (None: one node) and launch from the last committed step."""

    devices: int
    nodes: list[str] | None
    reason: Reason
    why: str
    epoch: int | None = None  # the event it follows; None: the job's own change (a failure, the script)
    announce: bool = False  # record and emit it as a resource event (a failure: visible like any change)

    def as_event(self, epoch: int) -> ResourceEvent:
        return ResourceEvent(devices=self.devices, nodes=self.nodes, epoch=epoch, reason=self.reason)


@dataclass(frozen=True)
class Fail:
    """The job cannot go on (`why` is the flow run's failure message)."""

    why: str


Decision = Ignore | Stop | Replan | Fail


# State and changes


@dataclass(frozen=True)
class JobState:
    """Where a running job stands."""

    devices: int
    nodes: list[str] | None = None  # a job across nodes: the nodes it runs on
    step: int = 0  # the last committed step
    epoch: int = -1  # the highest epoch of a resource event it has decided on
    segments: tuple[Segment, ...] = ()  # how its launches ended, oldest first
    # Nodes it lost because they left (their worker went away): taken back when they return
    # (`rejoined_nodes`). A node an event moved the job off is not one: it was let go.
    left: tuple[str, ...] = ()

    @classmethod
    def starting(cls, spec: JobSpec, step: int = 0) -> JobState:
        """A job that starts at `step` (its newest committed one): on the devices the spec's
        scripted changes up to that step give, as a run through them would have them (one that
        cannot apply is ignored, as at its step); the next scripted change is the first past it."""
        nodes = spec.resources.nodes
        job = cls(devices=spec.resources.devices, nodes=list(nodes) if nodes is not None else None, step=step)
        for change in spec.elasticity:
            if change.at_step > step:
                break
            with contextlib.suppress(ValueError):
                devices, on = apply_change(ResourceEvent(devices=change.devices, epoch=0), spec, job.devices, job.nodes)
                job = replace(job, devices=devices, nodes=on)
        return job

    def after(self, segment: Segment) -> JobState:
        """With `segment` ended: its last committed step, its outcome remembered."""
        return replace(self, step=segment.final_step, segments=(*self.segments, segment))

    def following(self, decision: Decision, epoch: int | None = None) -> JobState:
        """After acting on `decision` (`epoch`: the event the job recorded for it, if any)."""
        decided = decision.epoch if isinstance(decision, Ignore | Replan) else None
        heard = max(e for e in (self.epoch, epoch, decided) if e is not None)
        if isinstance(decision, Replan):
            return replace(self, devices=decision.devices, nodes=decision.nodes, epoch=heard,
                           left=self._left_after(decision))
        return replace(self, epoch=heard)

    def _left_after(self, change: Replan) -> tuple[str, ...]:
        """The nodes lost to a departure once `change` is made: a node that left joins them, one
        that came back leaves them, a worker's failure keeps them; any other change (an event
        naming nodes or devices, a scripted count) was asked for, and lets them all go."""
        now = change.nodes or []
        if change.reason == "node-left":
            return (*self.left, *(n for n in self.nodes or [] if n not in now and n not in self.left))
        if change.reason in ("node-joined", "failure"):
            return tuple(n for n in self.left if n not in now)
        return ()

    def describe(self) -> str:
        return f"nodes {','.join(self.nodes)}" if self.nodes is not None else counted(self.devices, "device")


@dataclass(frozen=True)
class SegmentEnded:
    """A launch of the workers ended."""

    segment: Segment
    scripted: ResourceChange | None = None  # the spec's next scripted change, the step it ran up to
    pending: ResourceEvent | None = None  # the newest event heard and not yet decided on


Change = ResourceEvent | SegmentEnded


# The rules


def admit(job_id: str, change: ResourceEvent, highest_epoch: int, sent_to: str | None = None) -> Ignore | None:
    """Whether the job hears an event at all: None when it does, else why not (another job's,
    or an epoch not above `highest_epoch`, every epoch the job has seen or recorded)."""
    if sent_to is not None and sent_to != job_id:
        return Ignore(f"{change.describe()} ({change.reason}, epoch {change.epoch}) is for job {sent_to}", change.epoch)
    if change.epoch <= highest_epoch:
        return Ignore(f"{change.describe()} ({change.reason}, epoch {change.epoch}): epoch not above {highest_epoch}",
                      change.epoch)
    return None


def check_change(change: ResourceEvent, spec: JobSpec) -> None:
    """ValueError (the rule) for a change the job refuses whatever it runs on now: nodes named to
    a job on one node, devices that are not whole nodes of a job across nodes, more devices than
    sequences per step, fewer or more than the job's own min_devices / max_devices."""
    per_node = spec.resources.devices_per_node or 1
    if change.devices is None:
        assert change.nodes is not None
        if spec.resources.nodes is None:
            raise ValueError(f"{change.describe()}: this job runs on one node; name devices, not nodes")
        devices = spec.resources.node_devices(change.nodes)
    else:
        devices = change.devices
        if spec.resources.nodes is not None and devices % per_node:
            raise ValueError(f"{devices} devices are not whole nodes of {per_node} devices")
    batch = spec.training.global_batch
    if devices > batch:
        raise ValueError(f"{devices} devices exceed training.global_batch ({batch}): every device needs at least "
                         "one sequence per step")
    match spec.resources.outside_bounds(devices):
        case ("min_devices", low):
            raise ValueError(f"{counted(devices, 'device')}: below resources.min_devices ({low})")
        case ("max_devices", high):
            raise ValueError(f"{devices} devices: above resources.max_devices ({high})")


def apply_change(change: ResourceEvent, spec: JobSpec, devices: int,
                 nodes: list[str] | None) -> tuple[int, list[str] | None]:
    """The devices and nodes a job that runs on `devices` on `nodes` (None: one node) runs on
    after `change`; ValueError (the rule) when the change cannot apply. A job across nodes takes
    a node list as it is, and a device count as the first nodes that hold it."""
    if nodes is None and change.devices is None:
        raise ValueError(f"{change.describe()}: this job runs on one node; name devices, not nodes")
    check_change(change, spec)
    if nodes is None:
        assert change.devices is not None
        return change.devices, None
    if change.nodes is not None:
        return spec.resources.node_devices(change.nodes), list(change.nodes)
    assert change.devices is not None
    per_node = spec.resources.devices_per_node or 1
    kept = nodes[: change.devices // per_node]
    if len(kept) * per_node != change.devices:
        raise ValueError(f"{change.devices} devices need more nodes than the {len(nodes)} running; name them")
    return change.devices, kept


def rejoined_nodes(spec: JobSpec, running: Sequence[str], back: Sequence[str]) -> list[str]:
    """The nodes a job across nodes runs on once the spec's nodes in `back` came back: those
    it runs on and those, in the spec's order."""
    return [n for n in spec.resources.nodes or [] if n in running or n in back]


def decide(spec: JobSpec, job: JobState, change: Change) -> Decision:
    """What the job does about `change`, given where it stands."""
    if isinstance(change, SegmentEnded):
        return _after_segment(spec, job, change)
    return _follow(spec, job, change)


def _follow(spec: JobSpec, job: JobState, change: ResourceEvent) -> Decision:
    what = f"{change.describe()} ({change.reason}, epoch {change.epoch})"
    if change.epoch <= job.epoch:
        return Ignore(f"{what}: epoch not above {job.epoch}", change.epoch)
    try:
        devices, nodes = apply_change(change, spec, job.devices, job.nodes)
    except ValueError as error:
        return Ignore(f"{what}: {error}", change.epoch)
    if devices == job.devices and nodes == job.nodes:
        return Ignore(f"{what}: the job runs on {job.describe()} already", change.epoch)
    return Replan(devices, nodes, change.reason, f"{change.reason}: {counted(job.devices, 'device')} -> {change.describe()}",
                  epoch=change.epoch)


def _after_segment(spec: JobSpec, job: JobState, ended: SegmentEnded) -> Decision:
    segment = ended.segment
    if segment.outcome == "fatal":
        return Fail(segment.reason or "the workers stopped with an error no retry can fix")
    if segment.outcome == "failed":
        return _after_failure(spec, job, segment)
    if segment.outcome == "stopped":
        return Stop(f"asked to stop at step {segment.final_step}")
    if segment.outcome == "rescaled":
        if ended.pending is None:
            return Ignore(f"stopped at step {segment.final_step} for a change no longer pending")
        return _follow(spec, job, ended.pending)
    scripted = ended.scripted
    if scripted is None or segment.final_step >= spec.training.steps:
        return Stop(f"finished at step {segment.final_step}")
    what = f"scripted change at step {scripted.at_step} to {counted(scripted.devices, 'device')} ({scripted.reason})"
    try:
        devices, nodes = apply_change(ResourceEvent(devices=scripted.devices, epoch=0), spec, job.devices, job.nodes)
    except ValueError as error:
        return Ignore(f"{what}: {error}")
    if devices == job.devices and nodes == job.nodes:
        return Ignore(f"{what}: the job runs on {job.describe()} already")
    return Replan(devices, nodes, scripted.reason, what)


def _after_failure(spec: JobSpec, job: JobState, failed: Segment) -> Decision:
    previous = job.segments[-1] if job.segments else None
    if (failed.final_step <= failed.start_step and previous is not None and previous.outcome == "failed"
            and previous.final_step <= previous.start_step):
        return Fail(f"{spec.job_id} cannot make progress: two failures in a row without a new checkpoint "
                    f"(last: {failed.reason}); the last committed step is {failed.final_step}")
    nodes = None
    if failed.nodes is not None:
        nodes = [n for n in failed.nodes if n not in failed.left_nodes]
        if not nodes:
            return Fail(f"{spec.job_id}: every node left ({', '.join(failed.left_nodes)}); "
                        f"the last committed step is {failed.final_step}")
        devices = spec.resources.node_devices(nodes)
        where = f"nodes {','.join(nodes)}"
    else:  # the failed worker's device is presumed gone; a later event can bring it back
        devices = count_after_failure(spec, failed.devices)
        where = counted(devices, 'device')
    who = "node" if failed.left_nodes else "worker"
    return Replan(devices, nodes, "node-left" if failed.left_nodes else "failure",
                  f"{who} failure on {counted(failed.devices, 'device')} ({failed.reason}): resuming from step "
                  f"{failed.final_step} on {where}", announce=True)


def segment_outcome(*, start_step: int, ended_at: int | None, stopped: bool, returncode: int,
                    committed_step: int | None = None, fatal: str | None = None, left_nodes: Sequence[str] = (),
                    failure: str = "", stopped_for: Decision | None = None,
                    stopped_for_change: bool = False) -> tuple[Outcome, str | None, int]:
    """How a segment ended: (outcome, reason, the last committed step).

    `ended_at`: the step of the workers' `finished` or `stopped` report (None: they sent none);
    `stopped`: they reported `stopped` (torchrun exits non-zero when it was signalled itself,
    although its workers stopped cleanly at a committed step: the report is what counts);
    `committed_step`: their last checkpoint; `fatal`: the error no retry can fix they reported;
    `left_nodes`: nodes that left; `failure`: what killed them, from torchrun's summary;
    `stopped_for`: the policy's decision on the newest event heard while they ran;
    `stopped_for_change`: they stopped for a change (holding their last step in memory for it,
    or at a step that committed on schedule), and nobody asked the job to stop. Such a segment
    was rescaled even where a newer event has taken the change back (the job goes on where it
    runs, from the step it stopped at): ending the job there would lose a held step, and stop
    a job nobody asked to stop.
    A failed segment's steps after its last checkpoint are trained again."""
    if fatal is not None:
        return "fatal", fatal, start_step
    if left_nodes or ended_at is None or (returncode != 0 and not stopped):
        if left_nodes:
            failure = f"node{'s' if len(left_nodes) > 1 else ''} {', '.join(left_nodes)} left"
        return "failed", failure, committed_step if committed_step is not None else start_step
    if stopped and isinstance(stopped_for, Replan):
        return "rescaled", stopped_for.why, ended_at
    if stopped and stopped_for_change:
        return "rescaled", "the change it stopped for was taken back by a newer one", ended_at
    return ("stopped" if stopped else "finished"), None, ended_at




def count_after_failure(spec: JobSpec, devices: int) -> int:
    """Where a job on one node goes when a worker of `devices` fails: one device fewer (the
    failed one is presumed gone), at least one, and at most one a sequence (a pinned mesh may
    have had more devices than sequences: its tensor-parallel degree stays where it can)."""
    return max(1, min(devices - 1, spec.training.global_batch))


def likely_counts(spec: JobSpec, job: JobState, most: int = 3) -> list[int]:
    """The device counts the job may move to next, most likely first, for plans made ahead
    (`tasks.plan.PlansAhead`): where this policy puts it after a failure (no event announces
    one), after the spec's next scripted change where it has one; then the counts it ran on
    before, newest first, and the spec's own."""
    scripted = spec.scripted_change_after(job.step)
    counts = [scripted.devices] if scripted is not None else []
    if job.nodes is not None:  # across nodes: a node leaves, or the spec's nodes come back
        counts += [(len(job.nodes) - 1) * (spec.resources.devices_per_node or 1), spec.resources.devices]
    else:
        counts += [count_after_failure(spec, job.devices), *(s.devices for s in reversed(job.segments)),
                   spec.resources.devices]
    low, high = spec.device_bounds()
    likely: list[int] = []
    for count in counts:
        if low <= count <= high and count != job.devices and count not in likely:
            likely.append(count)
    return likely[:most]


__all__ = ["REASONS", "UNPLANNED", "Change", "Decision", "Fail", "Ignore", "JobState", "Outcome", "Reason", "Replan",
           "ResourceEvent", "Segment", "SegmentEnded", "Stop", "admit", "apply_change", "check_change", "count_after_failure",
           "decide", "rejoined_nodes",
           "likely_counts", "segment_outcome"]
