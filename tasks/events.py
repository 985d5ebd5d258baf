"""Resource events: how a running job hears that its devices changed.

A change is a Prefect event `parashift.resources.changed` on resource `parashift.job.{job_id}`,
payload `{devices, epoch, reason}`. Anything that can reach the Prefect API may emit one
(`parashift scale`, a cluster tool, an automation); the job emits one itself with reason
`failure` when a worker dies. The running flow follows its own job's events over the API's
websocket (`ResourceWatcher`), so a change reaches it within the websocket's latency, with no
deployment trigger and no second flow run in between.

Prefect does not deliver events in order: the highest epoch wins (`specs.elastic.admit`, the
policy's rule), and every accepted change is recorded in the job's storage (`events/{epoch}.json`),
so a later run of the job ignores events older than what it already applied. Epochs default to
milliseconds since 1970. What a heard change does to the job is the policy's to decide
(`specs.elastic.decide`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from parashift.specs import JobSpec
from parashift.specs.elastic import ResourceEvent, admit, apply_change
from parashift.storage import JobPaths, ObjectStore, StorageError, open_store
from pydantic import ValidationError

EVENT = "parashift.resources.changed"
log = logging.getLogger("parashift.events")


def resource_id(job_id: str) -> str:
    return f"parashift.job.{job_id}"


def now_epoch() -> int:
    """The default epoch: milliseconds since 1970, so a later command outranks an earlier one."""
    return time.time_ns() // 1_000_000


# `parashift run`'s own embedded API (parashift/commands/embedded_api.py), if this process started one.
_embedded_api: str | None = None


def mark_embedded(url: str) -> None:
    """The API at `url` is this process's embedded one: `api_url` treats it as no server."""
    global _embedded_api
    _embedded_api = url


def api_url() -> str | None:
    """The Prefect API this process talks to; None on the embedded (ephemeral) API, which no
    other process can reach, so no event could arrive there."""
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value() or None
    return None if url is not None and url == _embedded_api else url


def emit_resource_change(job_id: str, change: ResourceEvent) -> None:
    """Send one resource event and wait until the API has it (`emit_event` alone sends in the
    background and may lose it when the process exits)."""
    from prefect.events import Event, Resource
    from prefect.events.clients import get_events_client

    event = Event(
        event=EVENT,
        resource=Resource({"prefect.resource.id": resource_id(job_id), "prefect.resource.name": job_id}),
        payload=change.model_dump(),
    )

    async def send() -> None:
        async with get_events_client() as client:
            await client.emit(event)

    asyncio.run(send())


class EventLog:
    """The job's accepted changes, kept in its storage: the highest epoch applied so far."""

    def __init__(self, store: ObjectStore, job_id: str) -> None:
        self.store, self.paths = store, JobPaths(job_id)

    def highest_epoch(self) -> int:
        epochs = []
        for key in self.store.list(self.paths.events_dir()):
            stem = key.rsplit("/", 1)[-1].removesuffix(".json")
            if stem.isdigit():
                epochs.append(int(stem))
        return max(epochs, default=-1)

    def record(self, change: ResourceEvent) -> None:
        try:
            self.store.put_json(self.paths.event(change.epoch), change.model_dump())
        except StorageError as error:  # the change still applies; only its record is missing
            log.warning("could not record resource change %s: %s", change, error)


class ResourceWatcher:
    """Follows one job's resource events in a background thread; keeps the newest change.

    An accepted change (`admit`: this job's, with a higher epoch than any seen or recorded) is
    recorded in the event log and handed to `on_change` (on the watcher's thread), which the
    launch sets while workers run; one not accepted is logged with the reason. What it does to
    the job is the policy's question (`specs.elastic.decide`). Changes the flow finds itself (a
    worker failure) go through `offer` too. `logger`: where accepted and ignored changes are
    said (the flow's run logger, usable from this thread)."""

    def __init__(self, job_id: str, event_log: EventLog | None = None,
                 logger: logging.Logger | logging.LoggerAdapter[Any] | None = None) -> None:
        self.job_id = job_id
        self.event_log = event_log
        self.log = logger if logger is not None else log
        self.highest_epoch = event_log.highest_epoch() if event_log is not None else -1
        self.latest: ResourceEvent | None = None
        self.on_change: Callable[[ResourceEvent], None] | None = None
        self.ignored: list[tuple[ResourceEvent, str]] = []
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def start(self, timeout_s: float = 30.0) -> bool:
        """Subscribe; True once events can arrive. False on the embedded API (nothing to hear)."""
        if api_url() is None:
            return False
        self._thread = threading.Thread(target=self._run, name=f"parashift-events-{self.job_id}", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s) and self.error is None:
            log.warning("resource events: no subscription after %.0f s; still trying", timeout_s)
        return self.error is None

    def stop(self) -> None:
        if self._loop is not None and self._task is not None:
            self._loop.call_soon_threadsafe(self._task.cancel)
        if self._thread is not None:
            self._thread.join(timeout=10)

    def offer(self, change: ResourceEvent, job_id: str | None = None) -> bool:
        """Take `change` if it is this job's and newer than any seen; True if taken."""
        with self._lock:
            echo = change == self.latest  # a change this job announced itself, back from the event feed
            refused = admit(self.job_id, change, self.highest_epoch, sent_to=job_id)
            if refused is None:
                self.highest_epoch, self.latest = change.epoch, change
            elif not echo:
                self.ignored.append((change, refused.why))
        if refused is not None:
            if not echo:
                self.log.info("resource change ignored: %s", refused.why)
            return False
        self.log.info("resource change for job %s: %s (%s, epoch %d)", self.job_id, change.describe(),
                      change.reason, change.epoch)
        if self.event_log is not None:
            self.event_log.record(change)
        on_change = self.on_change
        if on_change is not None:
            on_change(change)
        return True

    def wanted(self, running: int, nodes: list[str] | None = None) -> ResourceEvent | None:
        """The newest change if it asks for another device count than `running` (or, for a
        job across nodes, other `nodes`)."""
        with self._lock:
            latest = self.latest
        return latest if latest is not None and latest.differs(running, nodes) else None

    def newest_after(self, epoch: int) -> ResourceEvent | None:
        """The newest change if its epoch is above `epoch` (the last the job decided on)."""
        with self._lock:
            latest = self.latest
        return latest if latest is not None and latest.epoch > epoch else None

    def _run(self) -> None:
        self._loop = asyncio.new_event_loop()
        try:
            self._task = self._loop.create_task(self._follow())
            self._loop.run_until_complete(self._task)
        except asyncio.CancelledError:
            pass
        except BaseException as error:  # reported by start(); the job runs on without events
            self.error = error
            log.warning("resource events: the subscription failed: %s", error)
        finally:
            self._ready.set()
            self._loop.close()

    async def _follow(self) -> None:
        from prefect.events.clients import get_events_subscriber
        from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter

        wanted = EventFilter(event=EventNameFilter(name=[EVENT]),
                             resource=EventResourceFilter(id=[resource_id(self.job_id)]))
        async with get_events_subscriber(filter=wanted, reconnect_on_clean_close=True) as events:
            self._ready.set()
            async for event in events:
                self._receive(event.resource.id.removeprefix("parashift.job."), event.payload)

    def _receive(self, job_id: str, payload: dict[str, Any]) -> None:
        try:
            change = ResourceEvent.model_validate(payload)
        except ValidationError as error:
            self.log.warning("resource change ignored: a malformed %s event for job %s: %s", EVENT, job_id, error)
            return
        self.offer(change, job_id)


@contextlib.contextmanager
def follow_resources(spec: JobSpec,
                     logger: logging.Logger | logging.LoggerAdapter[Any] | None = None) -> Iterator[ResourceWatcher]:
    """A watcher of the job's resource events for the duration (stopped on exit); accepted
    changes are recorded in the job's storage (its credentials must be in the environment),
    accepted and ignored ones said to `logger`."""
    job_id = spec.job_id
    store = open_store(spec.storage)
    watcher = ResourceWatcher(job_id, EventLog(store, job_id), logger)
    try:
        if watcher.start():
            watcher.log.info("following resource events %s for %s", EVENT, resource_id(job_id))
        elif watcher.error is None:
            watcher.log.info("no Prefect server (PREFECT_API_URL unset): this run hears no resource events; "
                             "it follows its spec's elasticity and recovers from worker failures")
        yield watcher
    finally:
        watcher.stop()


__all__ = ["EVENT", "EventLog", "ResourceEvent", "ResourceWatcher", "api_url", "apply_change", "emit_resource_change",
           "follow_resources", "now_epoch", "resource_id"]
