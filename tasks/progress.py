"""Worker events -> whoever is watching in this process (the CLI's progress bar).

Tasks run in the flow's process, so a listener registered by `parashift run` sees every worker
event as the launch task parses it. With no listener this costs nothing.
"""

from __future__ import annotations

from collections.abc import Callable

from parashift.trainer.events import WorkerEvent

Listener = Callable[[WorkerEvent], None]
_listeners: list[Listener] = []


def add_listener(listener: Listener) -> None:
    _listeners.append(listener)


def remove_listener(listener: Listener) -> None:
    if listener in _listeners:
        _listeners.remove(listener)


def publish(event: WorkerEvent) -> None:
    for listener in list(_listeners):
        listener(event)
