"""Worker output as a person reads it in the run log: events as short lines, worker log records
at their own level with their rank, torchrun's warnings as warnings, and a failure's traceback
(with torchrun's failure summary after it) as one error record, not a line per record. The
structured events still reach the launcher unchanged (`trainer.events`)."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Literal

from parashift.specs.words import counted
from parashift.trainer.events import (
    CheckpointEvent,
    CheckpointStallEvent,
    FatalEvent,
    FinishedEvent,
    HeldEvent,
    RestoringEvent,
    StartEvent,
    StepEvent,
    StoppedEvent,
    WorkerEvent,
    parse,
)

# A worker's log record: "WARNING rank1 parashift.checkpoint: ..." (trainer.worker's format).
_RECORD = re.compile(r"^(?:\[\w+\]:)?(DEBUG|INFO|WARNING|ERROR|CRITICAL) (rank\d+ )?")
# torch's glog-style lines: "W1201 05:18:33.122000 1234 torch/...] message"
_GLOG = re.compile(r"^(?:\[\w+\]:)?([IWEF])\d{4} [\d:.]+ \d+ ")
_GLOG_LEVELS = {"I": logging.INFO, "W": logging.WARNING, "E": logging.ERROR, "F": logging.CRITICAL}
# Lines of a Python traceback or of torchrun's failure summary.
_FAILURE = ("Traceback (most recent call last)", "Error:", "ChildFailedError", "Root Cause", "exitcode", "Failures:")


def describe(event: WorkerEvent, total_steps: int | None = None) -> str:
    """One readable line for a worker event."""
    match event:
        case StepEvent():
            of = f"/{total_steps}" if total_steps else ""
            mfu = f"  MFU {event.mfu:.1%}" if event.mfu is not None else ""
            held = f"  eval loss {event.eval_loss:.4f}" if event.eval_loss is not None else ""
            return (f"step {event.step}{of}  loss {event.loss:.4f}  {event.tokens_per_s:,.0f} tok/s  "
                    f"{event.step_s * 1000:.0f} ms{mfu}{held}")
        case StartEvent():
            where = f"resuming at step {event.step}{_restored(event)}" if event.resumed else "starting at step 0"
            return f"{counted(event.world_size, 'worker')} (pids {event.pids}) {where}, training to step {event.end_step}"
        case RestoringEvent():
            return (f"rank 0 restores step {event.step}: {event.bytes_read / 1e6:,.1f} MB in {event.requests} reads "
                    f"(its share: {event.bytes_needed / 1e6:,.1f} MB needed, {event.bytes_local / 1e6:,.1f} MB from the node, "
                    f"{event.bytes_live / 1e6:,.1f} MB from live workers)")
        case CheckpointEvent():
            size = (f"{event.bytes_total / 1e6:,.1f} MB from {counted(event.ranks, 'rank')}" if event.ranks
                    else f"{event.bytes_written / 1e6:,.1f} MB")
            return (f"checkpoint step {event.step} committed: {size}, "
                    f"written in {event.write_s:.2f} s, training waited {event.stall_s:.3f} s")
        case CheckpointStallEvent():
            return f"step {event.step}: the loop waited {event.stall_s:.3f} s for a checkpoint"
        case FatalEvent():
            return event.message
        case HeldEvent():
            return (f"a peer died: rank {event.rank} holds step {event.step} whole in memory "
                    f"({event.samples_consumed:,} samples consumed) for the job's next segment")
        case FinishedEvent() if total_steps and event.step < total_steps:  # the end of its segment, not the job's
            return f"segment done at step {event.step} ({event.samples_consumed:,} samples consumed)"
        case StoppedEvent() | FinishedEvent():
            return f"{event.event} at step {event.step} ({event.samples_consumed:,} samples consumed)"
    fields = ", ".join(f"{k}={v}" for k, v in event.model_dump(exclude={"event", "received_at"}).items())
    return f"{event.event}: {fields}"


def _restored(event: StartEvent) -> str:
    """What every rank restored and from where, summed (the workers' own count: the flow's
    reshard view is planned from the checkpoint and cannot see what warm workers hold)."""
    got = event.restore_bytes
    if not got or not got.get("needed"):
        return ""
    took = f" in {event.restore_s:.2f} s" if event.restore_s is not None else ""
    return (f" ({got['needed'] / 1e6:,.1f} MB restored{took}: {got.get('live', 0) / 1e6:,.1f} MB from the workers' "
            f"memory, {got.get('local', 0) / 1e6:,.1f} MB from the node's tier, {got.get('store', 0) / 1e6:,.1f} MB "
            "from storage)")


# A loop's wait for a checkpoint below this is said at DEBUG: a line per save at 1-2 ms beside
# the commit's own line was noise in every run log.
NOTICEABLE_STALL_S = 0.05


def present(line: str, total_steps: int | None = None) -> tuple[int, str]:
    """(log level, message) for one line of worker output."""
    event = parse(line)
    if event is not None:
        if isinstance(event, CheckpointStallEvent) and event.stall_s < NOTICEABLE_STALL_S:
            return logging.DEBUG, describe(event, total_steps)
        return logging.ERROR if isinstance(event, FatalEvent) else logging.INFO, describe(event, total_steps)
    record = _RECORD.match(line)
    if record:
        return logging.getLevelName(record.group(1)), line
    glog = _GLOG.match(line)
    if glog:
        return _GLOG_LEVELS[glog.group(1)], line
    if any(marker in line for marker in _FAILURE):
        return logging.ERROR, line
    return logging.INFO, line


# Where a line came from: "[rank1]:" (torch prefixes a worker's uncaught exception with its rank),
# or "" (torchrun itself, or a worker before it joined its process group). Not "[0]:", a failure's
# index inside torchrun's summary.
_SOURCE = re.compile(r"^(\[[A-Za-z]\w*\]:) ?")
# torchrun's failure summary sits between two such borders, right after its ChildFailedError.
_BORDER = re.compile(r"^={10,}\s*$")
_TRACEBACK = "Traceback (most recent call last)"
_CHAINED = ("During handling of the above exception", "The above exception was the direct cause")
Part = Literal["frames", "raised", "summary", "done"]


def _source(line: str) -> tuple[str, str]:
    """(source, the line without it)."""
    match = _SOURCE.match(line)
    return (match.group(1), line[match.end():]) if match else ("", line)


def _foreign(line: str, body: str) -> bool:
    """A line that cannot be part of a traceback: a worker event or a log record (a process
    that shares the output interleaved it)."""
    return parse(line) is not None or bool(_RECORD.match(body) or _GLOG.match(body))


class _Failure:
    """One failure report being gathered: a traceback, any chained to it, and the failure summary
    torchrun prints after its own."""

    def __init__(self, line: str) -> None:
        self.lines = [line]
        self.part: Part = "frames"

    def takes(self, line: str, body: str) -> bool | None:
        """Whether `line` continues this report (None: it passes by, the report stays open)."""
        if self.part == "frames":
            if body[:1].isspace():
                self.lines.append(line)
                return True
            if _foreign(line, body):
                return None
            self.part = "raised"  # the exception line ends the frames
        elif self.part == "raised":
            if _TRACEBACK in body:
                self.part = "frames"
            elif _BORDER.match(body):
                self.part = "summary"
            elif not any(chained in body for chained in _CHAINED):
                return False
        elif self.part == "summary":
            if _foreign(line, body):
                return None
            if _BORDER.match(body):
                self.part = "done"
        self.lines.append(line)
        return True


class WorkerLog:
    """The run log's side of the workers' output: `present` line by line, except that a
    traceback (and torchrun's failure summary after it) becomes one ERROR record, so that a
    failure reads as one report at one level and not as dozens of records at mixed levels.
    Tracebacks of several ranks are gathered apart; `close` emits what is still open."""

    MAX_LINES = 400  # a runaway report is emitted in parts

    def __init__(self, emit: Callable[[int, str], None], total_steps: int | None = None) -> None:
        self.emit, self.total_steps = emit, total_steps
        self._open: dict[str, _Failure] = {}
        self._last = ""

    def __call__(self, line: str) -> None:
        source, body = _source(line)
        if not line.strip():  # blank lines carry no rank prefix: they belong to whoever wrote last
            self._blank(line)
            return
        self._close_raised(but=source)
        self._last = source
        failure = self._open.get(source)
        if failure is not None:
            taken = failure.takes(line, body)
            if taken is None:  # another process's line, amid this report
                self.emit(*present(line, self.total_steps))
                return
            if taken and failure.part != "done" and len(failure.lines) < self.MAX_LINES:
                return
            self._emit(source)
            if taken:
                return
        if _TRACEBACK in body:
            self._open[source] = _Failure(line)
            return
        self.emit(*present(line, self.total_steps))

    def close(self) -> None:
        """Emit every report still being gathered (the workers have exited)."""
        for source in list(self._open):
            self._emit(source)

    def _blank(self, line: str) -> None:
        failure = self._open.get(self._last)
        if failure is not None and failure.part != "frames":
            failure.lines.append(line)
        else:
            self.emit(*present(line, self.total_steps))

    def _close_raised(self, but: str) -> None:
        """A report whose exception line was its last ends when another process writes."""
        for source in [s for s, f in self._open.items() if s != but and f.part == "raised"]:
            self._emit(source)

    def _emit(self, source: str) -> None:
        failure = self._open.pop(source)
        self.emit(logging.ERROR, "\n".join(failure.lines).rstrip())


def job_run_logger(job_run_id: str | None) -> Callable[[int, str], None]:
    """Log a record on the job's flow run from this one: Prefect's API handler files a record
    under the `flow_run_id` it carries (nothing happens without one)."""
    if not job_run_id:
        return lambda level, message: None
    from prefect.logging.handlers import APILogHandler

    api_logger = logging.getLogger("parashift.node.job_run")  # to the API only: the console has them once
    api_logger.propagate = False
    if not api_logger.handlers:
        api_logger.addHandler(APILogHandler())
    api_logger.setLevel(logging.INFO)

    def log(level: int, message: str) -> None:
        api_logger.log(level, message, extra={"flow_run_id": job_run_id})

    return log
