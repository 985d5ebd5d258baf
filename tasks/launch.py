"""launch_training: torchrun the workers for one segment, their output streamed into the run log;
a resource change heard while they run that the elastic policy re-plans for stops them at a step
boundary (with a committed checkpoint), and a worker that dies ends the segment as `failed` for
the flow to recover. How the segment ended is the policy's reading (`specs.elastic.segment_outcome`)."""

from __future__ import annotations

import contextlib
import re
import signal
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

from parashift.launcher.launch import LaunchResult, RunningWorkers, launch_workers
from parashift.launcher.warm_launch import launch_warm
from parashift.launcher.warm_pool import WarmPool
from parashift.specs import JobSpec
from parashift.specs.elastic import JobState, Replan, ResourceEvent, decide, likely_counts, segment_outcome
from parashift.specs.plan import Plan
from parashift.storage import JobPaths, open_store
from parashift.tasks import progress
from parashift.tasks.artifacts import TrainingProgress
from parashift.tasks.credentials import environment, storage_environment
from parashift.tasks.events import ResourceWatcher
from parashift.tasks.nodes import node_launch
from parashift.tasks.plan import PlansAhead
from parashift.tasks.records import SegmentResult
from parashift.tasks.worker_log import WorkerLog
from parashift.trainer.events import HeldEvent, StartEvent, StepEvent, StoppedEvent, WorkerEvent
from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.logging import get_run_logger
from prefect.states import Failed, State

# torchrun's summary of a failed worker: "rank : 1 (local_rank: 1)" and "exitcode : -9 (pid: 123)"
_FAILED_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)")
_EXIT_CODE = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)")



def plan_label(plan: Plan) -> str:
    """What a segment ran, in one line: `dp 2 x tp 2, FSDP over 2, selective AC, 2 micro-batches`."""
    parts = [" x ".join(f"{axis} {n}" for axis, n in plan.mesh.items())]
    if plan.dp_shard > 1:
        parts.append(f"FSDP over {plan.dp_shard}")
    if plan.stage_activation_checkpointing:
        parts.append("AC per stage " + "/".join(plan.stage_activation_checkpointing))
    elif plan.activation_checkpointing != "none":
        parts.append(f"{plan.activation_checkpointing} AC")
    if plan.mixed_precision == "fsdp" and plan.degree("dp") > 1:
        parts.append("bf16 parameters")
    if plan.micro_batches > 1:
        parts.append(f"{plan.micro_batches} micro-batches")
    return ", ".join(parts)


def failure_reason(result: LaunchResult, lines: list[str]) -> str:
    """What killed the segment, from the root cause in torchrun's failure summary (the other
    ranks it lists were stopped by torchrun itself)."""
    if result.hung_s is not None:
        return f"workers reported nothing for {result.hung_s:.0f} s (hung; stopped by the launcher)"
    if result.failed_rank is not None:  # warm workers: the launcher saw the rank die itself
        rank, code = result.failed_rank
        how = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
        return f"rank {rank} {how} (a warm worker; another process takes its place)"
    found = root_cause(lines, result.first_exited)
    if found is not None:
        rank, code = found
        how = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
        return f"rank {rank} {how} (torchrun exited with {result.returncode})"
    return f"workers exited with code {result.returncode}"


def root_cause(lines: list[str], first_exited: list[int] | None = None) -> tuple[int, int] | None:
    """(rank, exit code) of the rank that brought a torchrun launch down, from its failure
    summary. torchrun's "Root Cause" is the first failure it happened to observe: when one rank
    is killed its peers' collectives break ("Connection reset by peer") and they exit 1 within
    the same poll, and torchrun may name one of them (then it kills the rest, by signal too).
    The launcher's own order of exits (`first_exited`, launcher.launch.ExitOrder) decides where
    it has one; among those ranks (or all, without it) one killed by a signal wins, since its
    peers' exits follow from it; else torchrun's root cause; else the first listed."""
    failures: list[tuple[int, int]] = []
    rank: int | None = None
    root_at: int | None = None
    for line in lines:
        if "Root Cause" in line:
            root_at = len(failures)
        if (m := _FAILED_RANK.match(line)) is not None:
            rank = int(m.group(1))
        elif (m := _EXIT_CODE.match(line)) is not None and rank is not None:
            failures.append((rank, int(m.group(1))))
            rank = None
    if not failures:
        return None
    first = [f for f in failures if f[0] in (first_exited or [])]
    if first:
        failures, root_at = first, None
    killed = [f for f in failures if f[1] < 0]
    if killed:
        return killed[0]
    return failures[root_at] if root_at is not None and root_at < len(failures) else failures[0]


# Warm workers of the jobs this process trains (resources.warm_workers), by job id: they outlive
# each segment and are ended with the job's flow run (`close_warm_workers`).
_warm_pools: dict[str, WarmPool] = {}
_warm_lock = threading.Lock()


@contextlib.contextmanager
def warm_workers(spec: JobSpec) -> Iterator[None]:
    """For the duration: the job's segments on one node run on warm workers, started at the
    first launch and ended here (where the spec asks for them)."""
    try:
        yield
    finally:
        with _warm_lock:
            pool = _warm_pools.pop(spec.job_id, None)
        if pool is not None:
            pool.close()


def _warm_pool(spec: JobSpec, devices: int) -> WarmPool:
    with _warm_lock:
        if spec.job_id not in _warm_pools:
            _warm_pools[spec.job_id] = WarmPool(devices, spec.resources.kind, spares=spec.resources.warm_spares)
        return _warm_pools[spec.job_id]


# Launches in progress in this process, by the function that stops each at a step boundary; and
# whether this process was asked to stop (a launch that starts afterwards stops at once).
_stoppers: set[Callable[[str], None]] = set()
_stoppers_lock = threading.Lock()
_interrupted = threading.Event()


def interrupt(reason: str) -> int:
    """Stop the training this process runs at the next step boundary, with a committed
    checkpoint (what `parashift run` does on SIGTERM or SIGINT); safe in a signal handler.
    Returns how many launches were asked."""
    _interrupted.set()
    with _stoppers_lock:
        stoppers = list(_stoppers)

    def run() -> None:  # storage calls stay out of the signal handler's frame
        for stop in stoppers:
            stop(reason)

    threading.Thread(target=run, name="parashift-interrupt", daemon=True).start()
    return len(stoppers)


def reset_interrupt() -> None:
    """Forget an `interrupt` (a process that goes on to run another job)."""
    _interrupted.clear()


# Set by `stop_on_signals`: what hears that a signal asked this process to stop.
_signal_listener: Callable[[str], None] | None = None


def _stop_signal_handler(signum: int, frame: object) -> None:
    if _interrupted.is_set():  # the second time: at once
        raise KeyboardInterrupt
    name = signal.Signals(signum).name
    interrupt(f"{name} to the process running the job")
    if _signal_listener is not None:
        _signal_listener(name)


def stop_on_signals(listener: Callable[[str], None] | None = None) -> None:
    """Make SIGTERM and SIGINT stop this process's training at the next step boundary, with a
    committed checkpoint (a second one: at once), for a process that runs one job and owns
    its signals, as `parashift run` does. Flow runs a Prefect worker started keep Prefect's
    handling (SIGTERM cancels them)."""
    global _signal_listener
    _signal_listener = listener
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _stop_signal_handler)


@contextlib.contextmanager
def signals_stop_training() -> Iterator[None]:
    """Within a flow run: keep `stop_on_signals` in force where the process asked for it
    (Prefect installs its own SIGTERM handler for the duration of every flow run)."""
    owned = _signal_listener is not None and threading.current_thread() is threading.main_thread()
    saved = signal.signal(signal.SIGTERM, _stop_signal_handler) if owned else None
    try:
        yield
    finally:
        if owned:
            signal.signal(signal.SIGTERM, saved)


# No task retries: a failed segment goes back to the flow, which resumes on the devices left.
@task(name="launch-training", cache_policy=NO_CACHE)
def launch_training(spec: JobSpec, plan: Plan, until_step: int | None = None,
                    resources: ResourceWatcher | None = None, progress_bar: TrainingProgress | None = None,
                    job: JobState | None = None, ahead: PlansAhead | None = None) -> SegmentResult:
    """Train on `plan.devices` workers until `until_step` (or the end), resuming if possible.
    `job`: where the job stands (the policy's question for a change heard meanwhile: re-plan?).
    `ahead`: where the counts the job may move to are planned, once it trains, and a count a
    change heard names at once."""
    logger = get_run_logger()
    job = job if job is not None else JobState(devices=plan.devices, nodes=spec.resources.nodes)
    watch = _SegmentWatch(spec, plan, job, resources, progress_bar, logger, ahead)
    if resources is not None:
        resources.on_change = watch.stop_for
        pending = resources.newest_after(job.epoch)
        if pending is not None:  # arrived while this segment was being planned
            watch.stop_for(pending)
    with _stoppers_lock:
        _stoppers.add(watch.stop)
    if _interrupted.is_set():  # asked before these workers existed: they stop at their first boundary
        watch.stop("interrupted before the launch")
    try:
        result, left = _launch(spec, plan, until_step, watch)
    finally:
        watch.relay.close()  # a failure report still being gathered
        with _stoppers_lock:
            _stoppers.discard(watch.stop)
        if resources is not None:
            resources.on_change = None
    return _ended(_segment_result(spec, plan, job, result, watch, left, resources))


class _SegmentWatch:
    """What a segment's launch is watched by: the stop (at a step boundary, by stop object and
    signal), the policy's reading of a change heard meanwhile, and the workers' output and
    events relayed to the run log, the progress bar and the step listeners."""

    def __init__(self, spec: JobSpec, plan: Plan, job: JobState, resources: ResourceWatcher | None,
                 progress_bar: TrainingProgress | None, logger: Any, ahead: PlansAhead | None = None) -> None:
        self.spec, self.plan, self.job, self.logger, self.progress_bar = spec, plan, job, logger, progress_bar
        self.ahead = ahead
        self.credentials = storage_environment(spec)
        with environment(self.credentials):
            self.store = open_store(spec.storage)
            self.stop_key = JobPaths(spec.job_id).stop()
            self.store.delete(self.stop_key)  # a stop request belongs to the run it stopped
        self.workers = RunningWorkers()
        self.lines: list[str] = []
        self.stepped: list[float] = []  # when the first and the newest step were heard, as they were reported
        self.relay = WorkerLog(logger.log, spec.training.steps)

    def stop(self, reason: str, devices: int | None = None) -> None:
        """Stop the workers at their next step boundary: the stop object reaches workers
        anywhere, the signal at once on this node. `devices`: the next segment's device count,
        when one follows on this node (warm workers then hold the step for it rather than save
        it first): written before the signal, so the workers read it when they stop."""
        said = {"reason": reason, "requested_at": datetime.now(UTC).isoformat()}
        if devices is not None:
            said["devices"] = devices
            with environment(self.credentials):
                self.store.put_json(self.stop_key, said)
        self.workers.request_stop()
        if devices is None:
            with environment(self.credentials):
                self.store.put_json(self.stop_key, said)

    def stop_for(self, change: ResourceEvent) -> None:
        decision = decide(self.spec, self.job, change)
        if not isinstance(decision, Replan):
            return  # the flow decides on it, and says why, when the segment ends
        self.logger.warning("resource change (%s, epoch %d): %d devices -> %s; stopping at the next step boundary",
                            change.reason, change.epoch, self.plan.devices, change.describe())
        if self.ahead is not None:  # planned while the workers finish their step
            self.ahead.prepare([decision.devices], first=True)
        self.stop(f"rescale to {change.describe()} ({change.reason})",
                  decision.devices if decision.nodes is None else None)

    def on_event(self, event: WorkerEvent) -> None:
        if isinstance(event, StepEvent) and self.ahead is not None:  # training: plan ahead (once per count)
            self.ahead.prepare(likely_counts(self.spec, self.job))
        if isinstance(event, StepEvent) and self.spec.resources.nodes is None:  # across nodes they arrive at the end
            now = time.time()
            self.stepped[:] = [self.stepped[0] if self.stepped else now, now]
        progress.publish(event)
        if self.progress_bar is not None and isinstance(event, StepEvent | StartEvent):
            try:
                self.progress_bar.update(event.step)
            except Exception as error:  # noqa: BLE001 - a progress display never stops training
                self.logger.debug("progress artifact not updated: %s", error)

    def on_line(self, line: str) -> None:
        self.lines.append(line)
        del self.lines[:-200]  # torchrun's failure summary is at the end
        self.relay(line)


def _launch(spec: JobSpec, plan: Plan, until_step: int | None, watch: _SegmentWatch) -> tuple[LaunchResult, list[str]]:
    """The segment on warm workers, torchrun's, or one launcher per node (each on its node's
    Prefect worker); the nodes that left, if any."""
    if spec.resources.nodes is None and spec.resources.warm_workers:
        return launch_warm(_warm_pool(spec, plan.devices), spec, plan, on_line=watch.on_line, on_event=watch.on_event,
                           until_step=until_step, extra_env=watch.credentials, workers=watch.workers), []
    if spec.resources.nodes is None:
        return launch_workers(spec, plan, on_line=watch.on_line, on_event=watch.on_event, until_step=until_step,
                              extra_env=watch.credentials, workers=watch.workers), []
    with environment(watch.credentials):
        across = node_launch(spec, plan, until_step, watch.store, watch.logger.info)
        result, left = across.run()
        watch.lines += across.tail()
    for event in result.events:
        watch.on_event(event)
    return result, left


def _segment_result(spec: JobSpec, plan: Plan, job: JobState, result: LaunchResult, watch: _SegmentWatch,
                    left: list[str], resources: ResourceWatcher | None) -> SegmentResult:
    """How the segment ended, as the elastic policy reads it (`segment_outcome`), with what the
    flow and the summary need of it; said in the run log where it failed."""
    logger, lines = watch.logger, watch.lines
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
    held = max((e.step for e in result.of(HeldEvent)), default=None)
    held = held if held is not None and held > (last_commit if last_commit is not None else start_step) else None
    outcome, reason, final_step = segment_outcome(
        start_step=start_step, ended_at=result.final_step, stopped=result.stopped, returncode=result.returncode,
        committed_step=held if held is not None else last_commit, fatal=fatal.message if fatal else None,
        left_nodes=left, failure=failure_reason(result, lines),
        stopped_for=decide(spec, job, pending) if pending is not None else None)
    if outcome == "fatal":
        logger.error("%s", reason)
    elif outcome == "failed" and held is not None:
        logger.error("workers failed: %s; the surviving workers hold step %d in memory (the last committed step "
                     "is %s): the job resumes there", reason, final_step, last_commit)
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
        losses=[(e.step, e.loss) for e in result.steps],
        eval_losses=[(e.step, e.eval_loss) for e in result.steps if e.eval_loss is not None],
        tokens_per_s=statistics.median(rates) if rates else None,
        mfu=statistics.median(mfus) if mfus else None,
        plan=plan_label(plan),
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
        held_unsaved=(outcome != "failed" and any(e.pending for e in result.of(StoppedEvent)))
        or (outcome == "failed" and held is not None),
    )


def _ended(segment: SegmentResult) -> SegmentResult:
    """The task run's end: a segment whose workers failed is a Failed task run (the run's task
    list shows which launch went wrong), its SegmentResult still the state's data, for the flow
    to recover from (`segment_of`)."""
    if not segment.failed:
        return segment
    what = "workers failed" if segment.outcome == "failed" else "cannot go on"
    return Failed(data=segment, message=f"{what} on {segment.devices} devices ({segment.reason}); "  # type: ignore[return-value]
                  f"the job resumes from step {segment.final_step}")


def segment_of(state: State[SegmentResult]) -> SegmentResult:
    """The segment a `launch_training` run (called with `return_state=True`) ended with, failed
    workers included; an error of the launch itself (a plan refused, the lease lost) raises."""
    if state.is_failed():
        ended = state.result(raise_on_failure=False)
        if isinstance(ended, SegmentResult):
            return ended
    return state.result()
