"""train_job: a job spec in, a trained and checkpointed model out.

    validate -> preflight -> profile -> until the job is done: plan -> launch (what the UI shows of it once it trains) -> ask the policy, act -> report

The job follows its resource events while it runs: a change of the device count (or, across
nodes, of the node set) stops the workers at a step boundary, and the next launch re-plans and
reshards onto it. A worker that dies is the same change with reason `failure`, a node that
leaves with `node-left`: the job resumes from its last committed checkpoint on what is left. A
node of the spec whose worker comes back is taken in again (`node-joined`). Every such rule is
the elastic policy's (`specs.elastic.decide`); this flow asks it and acts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from datetime import UTC, datetime
from functools import partial
from typing import Any

from parashift.launcher.interrupts import signals_stop_training
from parashift.launcher.job_workers import job_workers
from parashift.specs import JobSpec
from parashift.specs.elastic import Decision, Fail, Ignore, JobState, Replan, SegmentEnded, Stop, decide
from parashift.specs.plan import Plan
from parashift.specs.words import counted, counted_each
from parashift.storage import JobLease
from parashift.tasks.artifacts import TrainingProgress, job_tags, tag_devices, tag_this_run
from parashift.tasks.credentials import environment, storage_environment
from parashift.tasks.events import ResourceWatcher, follow_resources
from parashift.tasks.exclusive import one_run_per_job, one_writer_per_job
from parashift.tasks.launch import forget_earlier_stop, launch_training, segment_of
from parashift.tasks.node_watch import follow_nodes
from parashift.tasks.plan import PlansAhead, finish_plan, plan_parallelism, publish_plan
from parashift.tasks.pool_devices import pool_devices
from parashift.tasks.preflight import preflight_job
from parashift.tasks.profile import profile_model
from parashift.tasks.records import ModelSummary, SegmentResult, TrainSummary, failed_segments
from parashift.tasks.recovery import TrainingFailed, announce_change
from parashift.tasks.report import publish_report
from parashift.tasks.reshard import newest_committed_step, plan_reshard
from parashift.tasks.validate import validate_spec
from parashift.tasks.views import OnceTrained
from prefect import flow
from prefect.logging import get_run_logger
from prefect.states import Completed


@flow(name="train-job", flow_run_name="train-{spec.name}")
def train_job(spec: JobSpec, began_at: datetime | None = None) -> TrainSummary:
    """Train the job a spec describes, resuming from its latest committed checkpoint. A job
    asked to stop ends in a completed state named `Stopped` that says where (calling the flow
    still returns its summary). `began_at`: when the run was asked for (`parashift run`'s
    start; default: when the flow run was created, as a deployment's run waits for a worker):
    a stop request from before it is an earlier run's."""
    began_at = began_at or _created_at() or datetime.now(UTC)
    spec = validate_spec(spec)
    tag_this_run(job_tags(spec.job_id, spec.model.tag, spec.resources.devices))
    with environment(storage_environment(spec)):
        preflight_job(spec)  # storage, data, devices: a job that cannot run ends here, in seconds
    # One writer at a time (it prunes): the job's lease in storage first, whatever Prefect server
    # started this run; then the Prefect slot, freed if a dead run still holds it.
    with one_writer_per_job(spec) as lease, one_run_per_job(spec.job_id, storage_lease=True), \
            signals_stop_training(), job_workers(spec):
        summary = _train(spec, lease, began_at)
    if summary.segments and summary.segments[-1].stopped:
        return Completed(data=summary, name="Stopped",  # type: ignore[return-value]
                         message=f"{spec.job_id} stopped at step {summary.steps} of {spec.training.steps} "
                                 f"({summary.segments[-1].reason or 'asked to stop'}); run it again to resume")
    return summary


def _created_at() -> datetime | None:
    """When this flow run was created (by a deployment's trigger, the UI, a pool), per Prefect."""
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    created = context.flow_run.created if context is not None and context.flow_run is not None else None
    return created if isinstance(created, datetime) and created.tzinfo is not None else None


def _train(spec: JobSpec, lease: JobLease | None, began_at: datetime) -> TrainSummary:
    """Profile, then segment after segment until the job is done, stopped or cannot go on: after
    each segment, and on each change heard, ask the elastic policy (`specs.elastic`) and act.
    `lease`: the job's storage lease, renewed before each launch: a run whose lease was taken
    over launches nothing more (LeaseLost). `began_at`: stop requests from before it are not
    this run's."""
    logger = get_run_logger()
    forget_earlier_stop(spec, began_at)  # under the lease: a stop from before the run is not its
    profiles = {spec.resources.devices: profile_model(spec)}
    ahead = PlansAhead(spec, profiles[spec.resources.devices])  # the counts it may move to, planned while it trains
    segments: list[SegmentResult] = []
    job = JobState.starting(spec, newest_committed_step(spec))  # where an earlier run left it, on the script's devices there
    # The storage credentials stay in the environment while the job's events are recorded.
    progress = TrainingProgress(spec.job_id, spec.training.steps)
    with environment(storage_environment(spec)), follow_resources(spec, logger) as resources, \
            follow_nodes(spec, resources) as node_watch, contextlib.closing(ahead):
        while True:
            heard = resources.newest_after(job.epoch)  # while the last segment was planned, or before the first
            if heard is not None:
                job = _act(spec, job, decide(spec, job, heard), resources)
            if lease is not None:
                lease.ensure()  # LeaseLost: another run writes this job now
            here = spec if job.nodes is None else spec.on_nodes(job.nodes)  # the nodes of this segment
            node_watch.now_on(job.nodes, job.left)  # a node the job lost is taken back once its worker is
            scripted = spec.scripted_change_after(job.step)
            model, plan, show_plan = _plan(spec, job, profiles, ahead, segments)
            held = segments[-1].final_step if segments and segments[-1].held_unsaved else None
            # What the UI shows of the segment (what its workers read, its device tag, its plan
            # where made ahead), once they train; in a pool: its devices (its nodes'), held while they run.
            # The step its workers restore is the job's newest commit as it starts (a view made once
            # they train finds their own commits too: a fresh job's first segment was shown "moving
            # step 20" after committing step 20; workers that fall back from a damaged step show none).
            warm = bool(segments) and here.resources.warm_workers and job.nodes is None  # they hold the step
            views = [partial(plan_reshard.submit, here, plan, held, job.step, warm), partial(tag_devices, job.devices),
                     *show_plan]
            with OnceTrained(*views) as shown, pool_devices(here, job.devices):
                launched = launch_training(here, plan, scripted.at_step if scripted else None, resources, progress,
                                           job, ahead, shown.trained, return_state=True)  # Failed when the workers failed: the policy decides
            reads = next(iter(shown.results()), None)
            if isinstance(reads, BaseException):  # the workers' own reads decide the segment, not this view
                logger.warning("%s: the reshard view of %d devices failed: %s", spec.job_id, job.devices, reads)
            segment = segment_of(launched)
            segments.append(segment)
            decision = decide(spec, job, SegmentEnded(segment, scripted, resources.newest_after(job.epoch)))
            job = job.after(segment)
            if isinstance(decision, Stop):
                logger.info("%s %s", spec.job_id, decision.why)
                if segment.held_unsaved:  # held for a change that is not made: the warm workers end with the run
                    logger.warning("%s: step %d was held in the warm workers' memory for a change, not saved; the "
                                   "job resumes from its newest committed checkpoint", spec.job_id, segment.final_step)
                break
            job = _act(spec, job, decision, resources)
    progress.update(segments[-1].final_step if segments else 0, force=True)
    logger.info("%s: %s on %s", spec.job_id, counted(len(segments), "segment"),
                counted_each([s.devices for s in segments] or [0], "device", " -> "))
    for failure in failed_segments(segments):  # recovered from, but said
        logger.warning("%s: %s", spec.job_id, failure)
    return publish_report(spec, model, segments)


def _plan(spec: JobSpec, job: JobState, profiles: dict[int, ModelSummary], ahead: PlansAhead,
          segments: list[SegmentResult]) -> tuple[ModelSummary, Plan, list[Callable[[], Any]]]:
    """The segment's plan: taken from the plans made ahead where this count was (then also its
    publication, to be made once the segment trains), else profiled, planned and published now.
    Also the model's summary on this count."""
    measured = [s.restore_bytes_per_s for s in segments if s.restore_bytes_per_s]
    bandwidth = measured[-1] if measured else None
    prepared = ahead.take(job.devices) if segments else None
    if prepared is not None:
        profiles[job.devices] = prepared.model
        plan, choice = finish_plan(spec, prepared, job.step, bandwidth)
        return prepared.model, plan, [partial(publish_plan.submit, spec, prepared, plan, job.step, choice)]
    if job.devices not in profiles:  # the core share on this count; collectives measured once (cached in storage)
        first = profiles[spec.resources.devices].profile_key
        profiles[job.devices] = profile_model(spec.on_devices(job.devices), rates_from=first)
    model = profiles[job.devices]
    return model, plan_parallelism(spec, model, job.devices, job.step, bandwidth), []


def _act(spec: JobSpec, job: JobState, decision: Decision, resources: ResourceWatcher) -> JobState:
    """Do what the policy decided, short of stopping; where the job stands then."""
    match decision:
        case Fail(why=why):
            raise TrainingFailed(why)
        case Replan(announce=True):  # the job's own change (a failure): recorded and emitted like an event
            event = announce_change(spec, decision, resources)
            return job.following(decision, event.epoch if event is not None else None)
        case Replan(why=why):
            get_run_logger().info("re-planning: %s", why)
        case Ignore(why=why):
            get_run_logger().info("resource change ignored: %s", why)
    return job.following(decision)
