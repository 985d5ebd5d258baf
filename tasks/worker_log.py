"""Worker output as a person reads it in the run log: events as short lines, worker log records
at their own level with their rank, torchrun's warnings and failure reports as warnings and
errors. The structured events still reach the launcher unchanged (`trainer.events`)."""

from __future__ import annotations

import logging
import re

from trainer.events import (
    CheckpointEvent,
    CheckpointStallEvent,
    FatalEvent,
    FinishedEvent,
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
            return (f"step {event.step}{of}  loss {event.loss:.4f}  {event.tokens_per_s:,.0f} tok/s  "
                    f"{event.step_s * 1000:.0f} ms")
        case StartEvent():
            where = f"resuming at step {event.step}" if event.resumed else "starting at step 0"
            return f"{event.world_size} workers (pids {event.pids}) {where}, training to step {event.end_step}"
        case RestoringEvent():
            return (f"restoring step {event.step}: {event.bytes_read / 1e6:,.1f} MB in {event.requests} reads "
                    f"({event.bytes_needed / 1e6:,.1f} MB needed, {event.bytes_local / 1e6:,.1f} MB from the node)")
        case CheckpointEvent():
            return (f"checkpoint step {event.step} committed: {event.bytes_written / 1e6:,.1f} MB, "
                    f"written in {event.write_s:.2f} s, training waited {event.stall_s:.3f} s")
        case CheckpointStallEvent():
            return f"step {event.step}: the loop waited {event.stall_s:.3f} s for a checkpoint"
        case FatalEvent():
            return event.message
        case StoppedEvent() | FinishedEvent():
            return f"{event.event} at step {event.step} ({event.samples_consumed:,} samples consumed)"
    fields = ", ".join(f"{k}={v}" for k, v in event.model_dump(exclude={"event", "received_at"}).items())
    return f"{event.event}: {fields}"


def present(line: str, total_steps: int | None = None) -> tuple[int, str]:
    """(log level, message) for one line of worker output."""
    event = parse(line)
    if event is not None:
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
