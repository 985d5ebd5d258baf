"""Stopping at a step boundary: a signal from the launcher on this node (SIGUSR1, or SIGTERM
that torchrun forwards), a stop object in the job's storage (any node, any process), or a step
fixed in advance. Ranks agree on the decision before acting on it (one all-reduce per step), so
it is enough that one rank sees the request.

A warm worker's launcher also says when a peer of the job died (`PEER_FAILED_SIGNAL`): the
ranks that survive then leave the step they are computing at once (`PeerFailed`), instead of
finding out at its next collective, up to a whole forward and backward pass later."""

from __future__ import annotations

import signal
import time

from parashift.storage import JobPaths, ObjectStore

# The launcher's "stop at the next step boundary" (a rescale): SIGUSR1 is free in torch and
# torchrun, and unlike SIGTERM it does not make torchrun tear the workers down itself.
STOP_SIGNAL = signal.SIGUSR1
# The launcher's "a peer of this job died" to warm workers (`launcher.warm_launch`).
PEER_FAILED_SIGNAL = signal.SIGUSR2


class PeerFailed(RuntimeError):
    """A peer of this job died (the launcher said so): the step under way cannot complete."""


_leaving_allowed = False


def on_peer_failed(signum: int, frame: object) -> None:
    """PEER_FAILED_SIGNAL's handler in a warm worker (installed for its whole life): raises
    PeerFailed where the training loop allows it (`may_leave`), and is ignored elsewhere (the
    loop's next collective fails then anyway)."""
    if _leaving_allowed:
        raise PeerFailed("a peer of this job died (its launcher says so): leaving the step under way")


def may_leave(allowed: bool) -> None:
    """Whether PeerFailed may interrupt the loop now: only while the state is a whole step's
    (before the optimizer's update, never between it and the step count)."""
    global _leaving_allowed
    _leaving_allowed = allowed


class StopRequests:
    def __init__(self, store: ObjectStore, job_id: str, poll_every_s: float | None = None, poll: bool = True) -> None:
        """`poll`: whether this rank checks the stop object (one rank is enough: the decision is
        shared); signals are heard by every rank."""
        self._store = store
        self._stop_key = JobPaths(job_id).stop()
        # One existence check every 2 s (the spec's training.stop_poll_s) costs an S3 HEAD per
        # 2 s, whatever the step time; 0: every step, as tests of ms-long steps need.
        self._poll_every_s = 2.0 if poll_every_s is None else poll_every_s
        self._poll = poll
        self._last_poll = 0.0
        self._signalled = False
        for sig in (signal.SIGTERM, signal.SIGINT, STOP_SIGNAL):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        self._signalled = True

    def next_devices(self) -> int | None:
        """The device count the job's next segment runs on, when the stop object says one
        follows (a planned change: `tasks.launch` writes it before it signals); None for any
        other stop (asked to stop, a signal alone, nothing readable)."""
        try:
            said = self._store.get_json(self._stop_key)
        except Exception:  # noqa: BLE001 - a stop without a readable object is a plain stop
            return None
        devices = said.get("devices") if isinstance(said, dict) else None
        return devices if isinstance(devices, int) and not isinstance(devices, bool) and devices > 0 else None

    def requested(self) -> bool:
        """True once a signal arrived or the stop object exists (polled at most every few s)."""
        if self._signalled or not self._poll:
            return self._signalled
        now = time.monotonic()
        if now - self._last_poll >= self._poll_every_s:
            self._last_poll = now
            self._signalled = self._store.exists(self._stop_key)
        return self._signalled
