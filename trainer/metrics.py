"""Worker -> launcher reporting: rank 0 writes each event (`trainer.events`) as one line on its
stdout. The launcher parses these; everything else a worker prints is passed through as log text."""

from __future__ import annotations

import sys
import threading

from parashift.trainer.events import WorkerEvent, encode

# A worker's exit status for an error no retry can fix (it emits a `FatalEvent` saying what).
EXIT_FATAL = 3


# Events come from the training loop and from the checkpoint thread (commits): `print` writes a
# line and its newline separately, so two threads could interleave them into one unparsable
# line (seen under load: a step event lost). One write per event, one thread at a time.
_WRITING = threading.Lock()


def emit(event: WorkerEvent) -> None:
    line = encode(event) + "\n"
    with _WRITING:
        sys.stdout.write(line)
        sys.stdout.flush()
