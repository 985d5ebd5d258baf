"""Nodes that come back: a node the job lost because it left (`JobState.left`: its worker went
away, not an event that moved the job off it), whose Prefect worker is heard from again, becomes
a resource change naming the nodes the job has plus that one.

A node's worker is the worker named `node-NAME` of the node deployment's work pool (as
`parashift serve --nodes` and docs/nodes.md start them). "Heard from again": its last heartbeat
is later than the moment the job saw the node leave (a worker heartbeats as it starts), so a
worker that was killed, whose record still says ONLINE for a while, does not count.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator

from parashift.specs import JobSpec
from parashift.specs.elastic import ResourceEvent, rejoined_nodes
from parashift.tasks.events import ResourceWatcher, api_url, emit_resource_change

log = logging.getLogger("parashift.nodes")


class NodeWatch:
    def __init__(self, spec: JobSpec, resources: ResourceWatcher, poll_s: float = 3.0) -> None:
        self.spec, self.resources, self.poll_s = spec, resources, poll_s
        self.nodes: list[str] = list(spec.resources.nodes or [])
        self.left_at: dict[str, float] = {}
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._pool: str | None = None

    def now_on(self, nodes: list[str] | None, left: tuple[str, ...] = ()) -> None:
        """The job runs on `nodes` from now, and watches for the return of the nodes it lost
        (`left`; since now, if they were not watched already). A node it was moved off by an
        event is not taken back by itself (it was: 4 s after `parashift scale --nodes a`, at
        node b's next heartbeat)."""
        with self._lock:
            self.nodes = list(nodes or [])
            for node in self.spec.resources.nodes or []:
                if node in left and node not in self.nodes:
                    self.left_at.setdefault(node, time.time())
                else:
                    self.left_at.pop(node, None)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="parashift-node-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _heartbeats(self) -> dict[str, float]:
        """Worker name -> last heartbeat (seconds since 1970) of the node pool's workers."""
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            if self._pool is None:
                self._pool = client.read_deployment_by_name(self.spec.resources.node_deployment).work_pool_name
            workers = client.read_workers_for_work_pool(self._pool)
        return {w.name: w.last_heartbeat_time.timestamp() for w in workers if w.last_heartbeat_time is not None}

    def _run(self) -> None:
        while not self._done.wait(self.poll_s):
            with self._lock:
                waiting = dict(self.left_at)
            if not waiting:
                continue
            try:
                heard = self._heartbeats()
            except Exception as error:  # noqa: BLE001 - the job runs on; a later poll may succeed
                log.debug("reading the node pool's workers failed: %s", error)
                continue
            back = [n for n, since in waiting.items() if heard.get(f"node-{n}", 0.0) > since]
            if back:
                self._take_in(back)

    def _take_in(self, back: list[str]) -> None:
        with self._lock:
            wanted = rejoined_nodes(self.spec, self.nodes, back)
            for node in back:
                self.left_at.pop(node, None)
        change = ResourceEvent(nodes=wanted, epoch=self.resources.highest_epoch + 1, reason="node-joined")
        log.info("node %s is back (its worker is heard from again): running on %s next", ", ".join(back),
                 ", ".join(wanted))
        if self.resources.offer(change):
            with contextlib.suppress(Exception):  # the change applies anyway; the feed is for people
                emit_resource_change(self.spec.job_id, change)


@contextlib.contextmanager
def follow_nodes(spec: JobSpec, resources: ResourceWatcher) -> Iterator[NodeWatch]:
    """A NodeWatch for a job across nodes that talks to a Prefect server (idle otherwise). A
    job of a pool takes no node back by itself: the node it gave up may be another job's now,
    and the pool's controller says which nodes each job runs on (docs/pool.md)."""
    watch = NodeWatch(spec, resources)
    if spec.resources.nodes and spec.resources.pool is None and api_url() is not None:
        watch.start()
    try:
        yield watch
    finally:
        watch.stop()
