"""Worker output as a person reads it in the run log: events as short lines, worker log records
at their own level with their rank, torchrun's warnings and failure reports as warnings and
errors. The structured events still reach the launcher unchanged (`trainer.metrics`)."""

from __future__ import annotations

import logging
import re
from typing import Any

from trainer import metrics

# A worker's log record: "WARNING rank1 parashift.checkpoint: ..." (trainer.worker's format).
_RECORD = re.compile(r"^(?:\[\w+\]:)?(DEBUG|INFO|WARNING|ERROR|CRITICAL) (rank\d+ )?")
# torch's glog-style lines: "W1201 05:18:33.122000 1234 torch/...] message"
_GLOG = re.compile(r"^(?:\[\w+\]:)?([IWEF])\d{4} [\d:.]+ \d+ ")
_GLOG_LEVELS = {"I": logging.INFO, "W": logging.WARNING, "E": logging.ERROR, "F": logging.CRITICAL}
# Lines of a Python traceback or of torchrun's failure summary.
_FAILURE = ("Traceback (most recent call last)", "Error:", "ChildFailedError", "Root Cause", "exitcode", "Failures:")


def describe(event: dict[str, Any], total_steps: int | None = None) -> str:
    """One readable line for a worker event."""
    kind = event.get("event")
    if kind == "step":
        of = f"/{total_steps}" if total_steps else ""
        return (f"step {event['step']}{of}  loss {event['loss']:.4f}  {event['tokens_per_s']:,.0f} tok/s  "
                f"{event['step_s'] * 1000:.0f} ms")
    if kind == "start":
        where = f"resuming at step {event['step']}" if event.get("resumed") else "starting at step 0"
        return f"{event['world_size']} workers (pids {event.get('pids', [])}) {where}, training to step {event.get('end_step')}"
    if kind == "restoring":
        return (f"restoring step {event['step']}: {event['bytes_read'] / 1e6:,.1f} MB in {event['requests']} reads "
                f"({event['bytes_needed'] / 1e6:,.1f} MB needed, {event.get('bytes_local', 0) / 1e6:,.1f} MB from the node)")
    if kind == "checkpoint":
        return (f"checkpoint step {event['step']} committed: {event.get('bytes_written', 0) / 1e6:,.1f} MB, "
                f"written in {event.get('write_s', 0):.2f} s, training waited {event.get('stall_s', 0):.3f} s")
    if kind == "checkpoint_stall":
        return f"step {event['step']}: the loop waited {event['stall_s']:.3f} s for a checkpoint"
    if kind == "fatal":
        return str(event.get("message"))
    if kind in ("stopped", "finished"):
        return f"{kind} at step {event['step']} ({event.get('samples_consumed', 0):,} samples consumed)"
    fields = ", ".join(f"{k}={v}" for k, v in event.items() if k != "event")
    return f"{kind}: {fields}"


def present(line: str, total_steps: int | None = None) -> tuple[int, str]:
    """(log level, message) for one line of worker output."""
    event = metrics.parse(line)
    if event is not None:
        return logging.ERROR if event.get("event") == "fatal" else logging.INFO, describe(event, total_steps)
    record = _RECORD.match(line)
    if record:
        return logging.getLevelName(record.group(1)), line
    glog = _GLOG.match(line)
    if glog:
        return _GLOG_LEVELS[glog.group(1)], line
    if any(marker in line for marker in _FAILURE):
        return logging.ERROR, line
    return logging.INFO, line
