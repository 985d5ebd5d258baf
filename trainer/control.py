"""Stopping at a step boundary: a signal (torchrun forwards SIGTERM), a stop object in the job's
storage, or a step fixed in advance. Ranks agree on the decision before acting on it."""

from __future__ import annotations

import os
import signal
import time

from storage import JobPaths, ObjectStore


class StopRequests:
    def __init__(self, store: ObjectStore, job_id: str, poll_every_s: float | None = None) -> None:
        self._store = store
        self._stop_key = JobPaths(job_id).stop()
        # One existence check every 2 s costs an S3 HEAD per 2 s, whatever the step time;
        # PARASHIFT_STOP_POLL_SECONDS overrides it (0: every step, as tests of ms-long steps need).
        if poll_every_s is None:
            poll_every_s = float(os.environ.get("PARASHIFT_STOP_POLL_SECONDS", "2"))
        self._poll_every_s = poll_every_s
        self._last_poll = 0.0
        self._signalled = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        self._signalled = True

    def requested(self) -> bool:
        """True once a signal arrived or the stop object exists (polled at most every few s)."""
        if self._signalled:
            return True
        now = time.monotonic()
        if now - self._last_poll >= self._poll_every_s:
            self._last_poll = now
            self._signalled = self._store.exists(self._stop_key)
        return self._signalled
