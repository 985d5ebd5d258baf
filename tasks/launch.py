"""launch_training: one segment as a task, over `launcher.segment.launch_segment` (warm
workers or torchrun on this node; across nodes, one node launcher per node, `tasks.nodes`).

While the workers run it relays their output to the run log and their events to the progress
bar and the step listeners; a resource change the elastic policy re-plans for stops them at a
step boundary (with a committed checkpoint, or held in warm workers' memory) and names its
count to the plans made ahead; a worker that dies ends the segment as `failed` for the flow to
recover. How the segment ended is the policy's reading (`specs.elastic.segment_outcome`)."""

from __future__ import annotations

import logging
import statistics
import threading
import time
from datetime import UTC, datetime
from typing import Any

from parashift.launcher.interrupts import stoppable
from parashift.launcher.job_workers import warm_pool
from parashift.launcher.launch import LaunchResult, RunningWorkers
from parashift.launcher.segment import OutputTail, failure_reason, launch_segment
from parashift.specs import JobSpec
from parashift.specs.elastic import (
    UNPLANNED,
    JobState,
    Replan,
    ResourceEvent,
    decide,
    likely_counts,
    segment_outcome,
)
from parashift.specs.plan import Plan
from parashift.specs.words import counted
from parashift.storage import JobPaths, ObjectStore, StorageError, open_store
from parashift.tasks import progress
from parashift.tasks.artifacts import TrainingProgress
from parashift.tasks.credentials import environment, storage_environment
from parashift.tasks.events import ResourceWatcher
from parashift.tasks.nodes import node_launch
from parashift.tasks.plan import PlansAhead
from parashift.tasks.records import SegmentResult
from parashift.tasks.worker_log import WorkerLog
from parashift.trainer.events import StartEvent, StepEvent, StoppedEvent, WorkerEvent, step_scalars
from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.logging import get_run_logger
from prefect.states import Failed, State


# No task retries: a failed segment goes back to the flow, which resumes on the devices left.
@task(name="launch-training", cache_policy=NO_CACHE)
def launch_training(spec: JobSpec, plan: Plan, until_step: int | None = None,
                    resources: ResourceWatcher | None = None, progress_bar: TrainingProgress | None = None,
                    job: JobState | None = None, ahead: PlansAhead | None = None,
                    trained: threading.Event | None = None) -> SegmentResult:
    """Train on `plan.devices` workers until `until_step` (or the end), resuming if possible.
    `job`: where the job stands (the policy's question for a change heard meanwhile: re-plan?).
    `ahead`: where the counts the job may move to are planned, once it trains, and a count a
    change heard names at once. `trained`: set once the workers have trained a step."""
    logger = get_run_logger()
    job = job if job is not None else JobState(devices=plan.devices, nodes=spec.resources.nodes)
    watch = _SegmentWatch(spec, plan, job, resources, progress_bar, logger, ahead, trained)
    if resources is not None:
        resources.on_change = watch.stop_for
        pending = resources.newest_after(job.epoch)
        if pending is not None:  # arrived while this segment was being planned
            watch.stop_for(pending)
    try:
        with stoppable(watch.stop):  # by `interrupt` (a signal to `parashift run`), before the launch too
            result, left = _launch(spec, plan, until_step, watch)
    finally:
        watch.relay.close()  # a failure report still being gathered
        if resources is not None:
            resources.on_change = None
    return _ended(_segment_result(spec, plan, job, result, watch, left, resources))


class _SegmentWatch:
    """What a segment's launch is watched by: the stop (at a step boundary, by stop object and
    signal), the policy's reading of a change heard meanwhile, and the workers' output and
    events relayed to the run log, the progress bar and the step listeners."""

    def __init__(self, spec: JobSpec, plan: Plan, job: JobState, resources: ResourceWatcher | None,
                 progress_bar: TrainingProgress | None, logger: Any, ahead: PlansAhead | None = None,
                 trained: threading.Event | None = None) -> None:
        self.spec, self.plan, self.job, self.logger, self.progress_bar = spec, plan, job, logger, progress_bar
        self.ahead, self.trained = ahead, trained
        self.credentials = storage_environment(spec)
        with environment(self.credentials):
            self.store = open_store(spec.storage)
            self.stop_key = JobPaths(spec.job_id).stop()
            if not self._asked_to_stop():  # the last segment's change (a user's stop of this run is obeyed)
                self.store.delete(self.stop_key)
        self.workers = RunningWorkers()
        self.changing = False  # stopped for a change of device count on this node (`stop` with devices)
        self.stepped: list[float] = []  # when the first and the newest step were heard, as they were reported
        self.relay = WorkerLog(logger.log, spec.training.steps)
        self.output = OutputTail(self.relay)  # every line to the run log; the last ones for a failure's reason

    def stop(self, reason: str, devices: int | None = None, change: bool = False) -> None:
        """Stop the workers at their next step boundary: the stop object reaches workers
        anywhere, the signal at once on this node. `devices`: the next segment's device count,
        when one follows on this node (warm workers then hold the step for it rather than save
        it first): written before the signal, so the workers read it when they stop. `change`:
        a segment follows (any resource change): the next launch deletes this stop, where it
        obeys one that asks the job to stop."""
        said: dict[str, object] = {"reason": reason, "requested_at": datetime.now(UTC).isoformat()}
        if change:
            said["change"] = True
        if devices is not None:
            said["devices"] = devices
            self.changing = True
            with environment(self.credentials):
                self.store.put_json(self.stop_key, said)
        self.workers.request_stop()
        if devices is None:
            with environment(self.credentials):
                self.store.put_json(self.stop_key, said)

    def asked_to_stop(self) -> bool:
        """Whether the stop object asks the job to stop (`parashift stop`, a pool's preemption,
        a signal to `parashift run`): not a change's own (which says so, and may name the next
        device count)."""
        with environment(self.credentials):
            return self._asked_to_stop()

    def _asked_to_stop(self) -> bool:
        said = _stop_request(self.store, self.stop_key)  # None: none (a change's was a signal alone), or unreadable
        return said is not None and not (isinstance(said, dict) and ("devices" in said or said.get("change") is True))

    def stop_for(self, change: ResourceEvent) -> None:
        decision = decide(self.spec, self.job, change)
        if not isinstance(decision, Replan):
            return  # the flow decides on it, and says why, when the segment ends
        # Asked for (a scale, a pool's share) is the job working as meant; a device lost is not
        level = logging.WARNING if change.reason in UNPLANNED else logging.INFO
        self.logger.log(level, "resource change (%s, epoch %d): %s -> %s; stopping at the next step boundary",
                        change.reason, change.epoch, counted(self.plan.devices, "device"), change.describe())
        if self.ahead is not None:  # planned while the workers finish their step
            self.ahead.prepare([decision.devices], first=True)
        self.stop(f"rescale to {change.describe()} ({change.reason})",
                  decision.devices if decision.nodes is None else None, change=True)

    def on_event(self, event: WorkerEvent) -> None:
        if isinstance(event, StepEvent) and self.ahead is not None:  # training: plan ahead (once per count)
            self.ahead.prepare(likely_counts(self.spec, self.job))
        if isinstance(event, StepEvent) and self.trained is not None:
            self.trained.set()
        if isinstance(event, StepEvent) and self.spec.resources.nodes is None:  # across nodes they arrive at the end
            now = time.time()
            self.stepped[:] = [self.stepped[0] if self.stepped else now, now]
        progress.publish(event)
        if self.progress_bar is not None and isinstance(event, StepEvent | StartEvent):
            try:
                self.progress_bar.update(event.step)
            except Exception as error:  # noqa: BLE001 - a progress display never stops training
                self.logger.debug("progress artifact not updated: %s", error)


def forget_earlier_stop(spec: JobSpec, since: datetime) -> None:
    """A stop request made before `since` (when this run began) was meant for a run before it
    (the one it stopped, or none: a stop when nothing ran): deleted, this run does not obey it.
    One made since is obeyed, even before the first launch (its workers stop at their first
    step boundary); deleting every stop at each launch lost those (`parashift stop` a second
    after `parashift run`, or during a change). Called under the job's lease: a second run of a
    running job deletes nothing of the first's. `requested_at` is the requester's clock."""
    with environment(storage_environment(spec)):
        store, key = open_store(spec.storage), JobPaths(spec.job_id).stop()
        requested = _requested_at(_stop_request(store, key))
        if requested is None or requested < since:
            store.delete(key)


def _stop_request(store: ObjectStore, key: str) -> object | None:
    """The job's stop object as stored; None where there is none or it cannot be read."""
    try:
        return store.get_json(key)
    except (StorageError, OSError):
        return None


def _requested_at(said: object) -> datetime | None:
    """When a stop object says it was asked for (ISO time, or Unix seconds as a pool writes it)."""
    value = said.get("requested_at") if isinstance(said, dict) else None
    try:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return datetime.fromtimestamp(value, UTC)
        when = datetime.fromisoformat(value) if isinstance(value, str) else None
    except (ValueError, OverflowError, OSError):
        return None
    return when.replace(tzinfo=UTC) if when is not None and when.tzinfo is None else when


def _launch(spec: JobSpec, plan: Plan, until_step: int | None, watch: _SegmentWatch) -> tuple[LaunchResult, list[str]]:
    """The segment on this node (warm workers where the spec asks for them, else torchrun), or
    one launcher per node, each on its node's Prefect worker; the nodes that left, if any."""
    if spec.resources.nodes is None:
        warm = warm_pool(spec, plan.devices) if spec.resources.warm_workers else None
        return launch_segment(spec, plan, until_step=until_step, warm=warm, on_line=watch.output,
                              on_event=watch.on_event, extra_env=watch.credentials, workers=watch.workers), []
    with environment(watch.credentials):
        across = node_launch(spec, plan, until_step, watch.store, watch.logger.info)
        result, left = across.run()
        watch.output.lines += across.tail()
    for event in result.events:
        watch.on_event(event)
    return result, left


def _segment_result(spec: JobSpec, plan: Plan, job: JobState, result: LaunchResult, watch: _SegmentWatch,
                    left: list[str], resources: ResourceWatcher | None) -> SegmentResult:
    """How the segment ended, as the elastic policy reads it (`segment_outcome`), with what the
    flow and the summary need of it; said in the run log where it failed."""
    logger, lines = watch.logger, watch.output.lines
    start = result.start
    # Workers that failed before they started training were resuming the step they read, or
    # else the job's last committed one.
    start_step = start.step if start is not None else result.restoring.step if result.restoring else job.step
    committed = [(e.step, e.url) for e in result.checkpoints if e.url]
    fatal = result.fatal
    pending = resources.newest_after(job.epoch) if resources is not None and result.stopped else None
    # A segment that restored a step live ranks held by a pending manifest and committed nothing
    # has the commit before that step as its last committed one.
    durable = result.restoring.durable_step if result.restoring else None
    last_commit = committed[-1][0] if committed else durable
    # Warm workers that survived a peer's death and hold their last step whole: the next
    # segment resumes there, not at the last commit (`trainer.checkpoint.live`).
    held = result.held_step()
    held = held if held is not None and held > (last_commit if last_commit is not None else start_step) else None
    held_for_change = any(e.pending for e in result.of(StoppedEvent))  # warm workers kept their last step for it
    outcome, reason, final_step = segment_outcome(
        start_step=start_step, ended_at=result.final_step, stopped=result.stopped, returncode=result.returncode,
        committed_step=held if held is not None else last_commit, fatal=fatal.message if fatal else None,
        left_nodes=left, failure=failure_reason(result, lines),
        stopped_for=decide(spec, job, pending) if pending is not None else None,
        stopped_for_change=watch.changing and not watch.asked_to_stop())  # (warm workers hold a step only then)
    if outcome == "fatal":
        logger.error("%s", reason)
    elif outcome == "failed" and held is not None:
        logger.error("workers failed: %s; the surviving workers hold step %d in memory (%s): the job resumes there",
                     reason, final_step, "no step committed yet" if last_commit is None
                     else f"the last committed step is {last_commit}")
    elif outcome == "failed":
        logger.error("workers failed: %s; the last committed step is %d", reason, final_step)
    rates = [e.tokens_per_s for e in result.steps[1:]]  # the first step pays for warm-up
    mfus = [e.mfu for e in result.steps[1:] if e.mfu is not None]
    read = result.restoring
    restore_rate = None
    if read is not None and start is not None and start.restore_s and read.bytes_read > 0:
        restore_rate = read.bytes_read * start.world_size / start.restore_s
    return SegmentResult(
        devices=plan.devices, start_step=start_step, final_step=final_step, outcome=outcome, reason=reason,
        losses=result.losses(),
        eval_losses=[(e.step, e.eval_loss) for e in result.steps if e.eval_loss is not None],
        tokens_per_s=statistics.median(rates) if rates else None,
        mfu=statistics.median(mfus) if mfus else None,
        plan=plan.describe(),
        checkpoint_urls=[url for _, url in committed],
        resumed_from_url=start.checkpoint_url if start else None,
        resumed_loss=start.checkpoint_loss if start else None,
        restore_bytes_per_s=restore_rate,
        restore_bytes=start.restore_bytes if start else None,
        nodes=spec.resources.nodes,
        left_nodes=left,
        mesh=dict(plan.mesh),
        first_step_at=watch.stepped[0] if watch.stepped else None,
        last_step_at=watch.stepped[-1] if watch.stepped else None,
        held_unsaved=(outcome != "failed" and held_for_change)
        or (outcome == "failed" and held is not None),
        scalars_past_commit=_unreported(result, plan.devices, last_commit if last_commit is not None else start_step,
                                        held if outcome == "failed" else None),
    )


def _unreported(result: LaunchResult, devices: int, committed: int, held: int | None) -> list[tuple[int, dict[str, float]]]:
    """What the report may have to fill in TensorBoard of a failed segment whose warm workers
    hold step `held` past its last commit: its steps' scalars, where rank 0 may have lost some."""
    return scalars_between(result, devices, committed, held) if held is not None and _rank_0_lost_some(result, held) \
        else []


def _rank_0_lost_some(result: LaunchResult, held: int) -> bool:
    """Whether TensorBoard may lack steps up to the `held` one: rank 0 died (what it had not
    copied went with it), or it did not complete the held step (another rank did). A rank 0 that
    outlived its peer copied every step it recorded at its end."""
    return 0 in result.lost_ranks or held not in {e.step for e in result.steps}


def scalars_between(result: LaunchResult, devices: int, after: int, held: int) -> list[tuple[int, dict[str, float]]]:
    """The TensorBoard scalars of the logged steps after `after` up to the `held` step, as rank 0
    reported them; a step rank 0 did not report (the held one, where it died in it) with its loss."""
    reported = {e.step: step_scalars(e, devices) for e in result.steps if after < e.step <= held}
    for step, loss in result.losses():
        if after < step <= held and step not in reported:
            reported[step] = {"loss": loss}
    return sorted(reported.items())


def _ended(segment: SegmentResult) -> SegmentResult:
    """The task run's end: a segment whose workers failed is a Failed task run (the run's task
    list shows which launch went wrong), its SegmentResult still the state's data, for the flow
    to recover from (`segment_of`)."""
    if not segment.failed:
        return segment
    what = "workers failed" if segment.outcome == "failed" else "cannot go on"
    return Failed(data=segment, message=f"{what} on {counted(segment.devices, 'device')} ({segment.reason}); "  # type: ignore[return-value]
                  f"the job resumes from step {segment.final_step}")


def segment_of(state: State[SegmentResult]) -> SegmentResult:
    """The segment a `launch_training` run (called with `return_state=True`) ended with, failed
    workers included; an error of the launch itself (a plan refused, the lease lost) raises."""
    if state.is_failed():
        ended = state.result(raise_on_failure=False)
        if isinstance(ended, SegmentResult):
            return ended
    return state.result()
