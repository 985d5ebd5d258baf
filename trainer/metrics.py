"""Worker -> launcher reporting: one JSON object per line behind a fixed prefix, on rank 0's stdout.
The launcher parses these; everything else a worker prints is passed through as log text."""

from __future__ import annotations

import json
import sys
import threading
from typing import Any

PREFIX = "PARASHIFT "

# A worker's exit status for an error no retry can fix (it emits a "fatal" event saying what).
EXIT_FATAL = 3


# Events come from the training loop and from the checkpoint thread (commits): `print` writes a
# line and its newline separately, so two threads could interleave them into one unparsable
# line (seen under load: a step event lost). One write per event, one thread at a time.
_WRITING = threading.Lock()


def emit(event: str, **fields: Any) -> None:
    line = PREFIX + json.dumps({"event": event, **fields}, sort_keys=True) + "\n"
    with _WRITING:
        sys.stdout.write(line)
        sys.stdout.flush()


def parse(line: str) -> dict[str, Any] | None:
    """The event a worker line carries, or None for plain log text. torchrun may prefix lines
    with `[rank]:`, so the prefix is searched, not matched at the start."""
    at = line.find(PREFIX)
    if at < 0:
        return None
    try:
        event = json.loads(line[at + len(PREFIX) :])
    except json.JSONDecodeError:
        return None
    return event if isinstance(event, dict) else None
