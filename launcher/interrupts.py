"""Stopping the training this process runs, at a step boundary with a committed checkpoint:
`interrupt` (what `parashift run` does on SIGTERM or SIGINT, `stop_on_signals`) asks every
launch in progress here (`stoppable`), and one that starts afterwards stops at its first
boundary. Prefect-free: a process owns its signals, whatever orchestrates it."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator

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


def owns_signals() -> bool:
    """Whether this process stops its training on its own signals (`stop_on_signals`)."""
    return _signal_listener is not None


@contextlib.contextmanager
def signals_stop_training() -> Iterator[None]:
    """Within a flow run: keep `stop_on_signals` in force where the process asked for it
    (Prefect installs its own SIGTERM handler for the duration of every flow run)."""
    owned = owns_signals() and threading.current_thread() is threading.main_thread()
    saved = signal.signal(signal.SIGTERM, _stop_signal_handler) if owned else None
    try:
        yield
    finally:
        if owned:
            signal.signal(signal.SIGTERM, saved)


@contextlib.contextmanager
def stoppable(stop: Callable[[str], None]) -> Iterator[None]:
    """For the duration: `interrupt` reaches this launch by `stop` (called at once where this
    process was interrupted before the launch: its workers stop at their first boundary)."""
    with _stoppers_lock:
        _stoppers.add(stop)
    if _interrupted.is_set():
        stop("interrupted before the launch")
    try:
        yield
    finally:
        with _stoppers_lock:
            _stoppers.discard(stop)
