"""A segment across nodes: one launcher per node, each a Prefect run on that node's worker.

The job's flow starts a run of the node deployment (`flows/node.py`) per node, on the work queue
named after the node (a node's Prefect worker serves that queue). The node of rank 0 picks the
rendezvous endpoint and publishes it in the job's storage (one place decides it; storage is what
every node reaches); the others read it and join with torchrun's static rendezvous. Each
launcher streams its workers' lines into its own run's log, labelled by node and rank, and
leaves a report in storage when its workers exit, which the job's flow reads.

A node leaves when its worker process goes away (its launcher then stops the node's workers at
once), when its launcher dies, or when it never starts (no worker serves its queue): its report
says `left`, or there is none. The job re-plans on the nodes it has, as for any resource change.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from parashift.launcher.launch import LaunchResult, NodeRendezvous, RunningWorkers
from parashift.specs import JobSpec, environ
from parashift.specs.plan import Plan
from parashift.storage import JobPaths, LeaseToken, ObjectStore, StorageError
from parashift.tasks.artifacts import job_tags, node_tag
from parashift.trainer.events import WorkerEvent
from pydantic import BaseModel, Field

# How long the other nodes wait for node 0's endpoint, and the job for a node's launcher to start.
RENDEZVOUS_WAIT_S = 180.0
NODE_START_S = 180.0
# After the first node's report, how long the others get to report before they are stopped.
SETTLE_S = 60.0


class NodeReport(BaseModel):
    """What a node's launcher saw: its workers' exit, their events, and whether the node left."""

    node: str
    returncode: int
    events: list[WorkerEvent] = Field(default_factory=list)
    hung_s: float | None = None
    hang_suspects: dict[int, str] = Field(default_factory=dict, description="hung: this node's ranks the others waited for")
    left: bool = Field(False, description="the node's worker went away: its workers were stopped")
    tail: list[str] = Field(default_factory=list, description="the last output lines (torchrun's failure summary)")

    def launch_result(self) -> LaunchResult:
        return LaunchResult(returncode=self.returncode, events=list(self.events), hung_s=self.hung_s,
                            hang_suspects=dict(self.hang_suspects))


def node_address() -> str:
    """The address other nodes reach this one at: `PARASHIFT_NODE_ADDR` (set on the node's
    worker), else the host name's address."""
    return os.environ.get(environ.NODE_ADDR) or socket.gethostbyname(socket.gethostname())


def _free_port(addr: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((addr, 0))
        return int(sock.getsockname()[1])


def meet(store: ObjectStore, job_id: str, launch_id: str, nodes: list[str], node: str,
         wait_s: float = RENDEZVOUS_WAIT_S) -> NodeRendezvous:
    """This node's rendezvous: node 0 publishes `addr:port`, the others wait for it."""
    key = JobPaths(job_id).launch(launch_id, "rendezvous")
    rank = nodes.index(node)
    if rank == 0:
        addr = node_address()
        endpoint = {"addr": addr, "port": _free_port(addr), "node": node}
        store.put_json(key, endpoint)
    else:
        deadline = time.monotonic() + wait_s
        while True:
            with contextlib.suppress(StorageError):
                if store.exists(key):
                    endpoint = store.get_json(key)
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"node {nodes[0]} (rank 0) published no rendezvous for launch {launch_id} "
                                   f"within {wait_s:.0f} s")
            time.sleep(0.5)
    return NodeRendezvous(tuple(nodes), rank, str(endpoint["addr"]), int(endpoint["port"]))


@contextlib.contextmanager
def stop_workers_when(store: ObjectStore, job_id: str, launch_id: str, workers: RunningWorkers,
                      left: threading.Event, poll_s: float = 0.5) -> Iterator[None]:
    """Kill this node's workers at once when the node leaves or the launch is aborted.

    Leaves: the process that started this one (the node's Prefect worker) went away; its ranks
    must not hold the others in a collective (sets `left`). Aborted: the job asked the whole
    launch to end (a node never came, or the others are gone), and these workers may wait on a
    rendezvous or a collective forever."""
    parent = os.getppid()
    abort = JobPaths(job_id).launch(launch_id, "abort")
    done = threading.Event()

    def watch() -> None:
        checked = 0.0
        while not done.wait(poll_s):
            if os.getppid() != parent:
                # Nobody reads this process's output any more (the worker held the pipe):
                # writing there would kill it before it reports to the job.
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, 1)
                os.dup2(devnull, 2)
                os.close(devnull)
                left.set()
                workers.kill()
                return
            if time.monotonic() - checked >= 1.0:  # storage is polled less often than the pid
                checked = time.monotonic()
                with contextlib.suppress(StorageError):
                    if store.exists(abort):
                        workers.kill()
                        return

    thread = threading.Thread(target=watch, name="parashift-node-watch", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(timeout=5)


def new_launch_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:8]


class NodeLaunch:
    """The job's side of a segment across nodes: start a launcher run per node, follow them,
    and gather their reports into one result.

    `start(node)` starts one node's launcher (a deployment run on the node's queue; a function,
    so tests and other orchestrators can start them otherwise); `state(run)` returns its
    Prefect state type name, `cancel(run)` cancels one that never started."""

    def __init__(self, spec: JobSpec, plan: Plan, nodes: list[str], store: ObjectStore,
                 start: Callable[[str, str], Any], state: Callable[[Any], str], cancel: Callable[[Any], None],
                 log: Callable[[str], None] = lambda message: None) -> None:
        self.spec, self.plan, self.nodes, self.store = spec, plan, list(nodes), store
        self._start, self._state, self._cancel, self._log = start, state, cancel, log
        self.launch_id = new_launch_id()
        self.paths = JobPaths(spec.job_id)

    def _report(self, node: str) -> NodeReport | None:
        key = self.paths.launch(self.launch_id, f"node-{node}")
        try:
            return NodeReport.model_validate(self.store.get_json(key)) if self.store.exists(key) else None
        except (StorageError, ValueError):
            return None

    def abort(self) -> None:
        with contextlib.suppress(StorageError):
            self.store.put_json(self.paths.launch(self.launch_id, "abort"), {"at": time.time()})

    def run(self, poll_s: float = 1.0, start_s: float = NODE_START_S, settle_s: float = SETTLE_S) -> tuple[LaunchResult, list[str]]:
        """Every node's launcher to its end; the combined result (rank 0's events, the first
        failure's exit code) and the nodes that left."""
        runs = {node: self._start(node, self.launch_id) for node in self.nodes}
        started_at = time.monotonic()
        reports: dict[str, NodeReport] = {}
        gone: set[str] = set()  # ended without a report, or never started
        first_end: float | None = None
        aborted = False
        while len(reports) + len(gone) < len(self.nodes):
            time.sleep(poll_s)
            now = time.monotonic()
            for node, run in runs.items():
                if node in reports or node in gone:
                    continue
                report = self._report(node)
                if report is not None:
                    reports[node] = report
                    continue
                state = self._state(run)
                if state in ("SCHEDULED", "PENDING") and now - started_at > start_s:
                    self._log(f"node {node}: its launcher did not start within {start_s:.0f} s (no worker on its queue?)")
                    self._cancel(run)
                    gone.add(node)
                elif state in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED", "CANCELLING"):
                    report = self._report(node)  # written just before the run ended
                    if report is not None:
                        reports[node] = report
                    else:
                        self._log(f"node {node}: its launcher ended ({state}) without a report")
                        gone.add(node)
            if (reports or gone) and first_end is None:
                first_end = now
            if gone and not aborted:
                self.abort()  # the others may wait for the missing node forever
                aborted = True
            if first_end is not None and now - first_end > settle_s and not aborted:
                self.abort()
                aborted = True
            if aborted and first_end is not None and now - first_end > settle_s * 2:
                for node in self.nodes:
                    if node not in reports and node not in gone:
                        self._log(f"node {node}: no report {settle_s * 2:.0f} s after the others ended")
                        gone.add(node)
        left = [n for n in self.nodes if n in gone or (n in reports and reports[n].left)]
        lead = reports.get(self.nodes[0]) or next(iter(reports.values()), None)
        if lead is None:
            return LaunchResult(returncode=-1), left
        result = lead.launch_result()
        failed = [r.returncode for r in reports.values() if r.returncode != 0]
        if left or failed:
            result.returncode = failed[0] if failed else -1
        if any(r.hung_s for r in reports.values()):
            result.hung_s = max(r.hung_s or 0.0 for r in reports.values())
            result.hang_suspects = {rank: why for r in reports.values() for rank, why in r.hang_suspects.items()}
        return result, left

    def tail(self) -> list[str]:
        """Every reported node's last lines, labelled (for the failure summary)."""
        lines = []
        for node in self.nodes:
            report = self._report(node)
            if report is not None:
                lines += report.tail
        return lines


def node_launch(spec: JobSpec, plan: Plan, until_step: int | None, store: ObjectStore,
                log: Callable[[str], None] = lambda message: None, measure_comm: bool = False) -> NodeLaunch:
    """A NodeLaunch whose launchers are runs of the spec's node deployment, each on the work
    queue of its node (linked to the calling flow or task run). `measure_comm`: they time
    collectives instead of training."""
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment
    from prefect.states import Cancelled

    nodes = list(spec.resources.nodes or [])
    # The job's lease token (tasks.exclusive) travels to every node: the node's rank 0 commits
    # checkpoints, and a commit without the token would be unfenced.
    fence = LeaseToken.from_env()
    job_run = job_run_id()

    def start(node: str, launch_id: str) -> Any:
        run = run_deployment(
            spec.resources.node_deployment, timeout=0, work_queue_name=node, flow_run_name=f"{spec.job_id}-{node}",
            # found by the job's filters in the UI, and by node
            tags=[*job_tags(spec.job_id, spec.model.tag, plan.devices), node_tag(node)],
            # for work pools whose job template places runs by node (docs/nodes.md: Kubernetes)
            job_variables={"parashift_node": node},
            parameters={"spec": spec.model_dump(mode="json"), "plan": plan.model_dump(mode="json"),
                        "launch_id": launch_id, "nodes": nodes, "node": node, "until_step": until_step,
                        "measure_comm": measure_comm, "lease_token": str(fence) if fence else None,
                        "job_run_id": job_run})
        log(f"node {node}: launcher run {run.id} queued on work queue {node!r}")
        return run.id

    def state(run_id: Any) -> str:
        with get_client(sync_client=True) as client:
            found = client.read_flow_run(run_id).state
        return found.type.name if found is not None else "SCHEDULED"

    def cancel(run_id: Any) -> None:
        with get_client(sync_client=True) as client:
            client.set_flow_run_state(run_id, Cancelled(message="its node never started it"), force=True)

    return NodeLaunch(spec, plan, nodes, store, start, state, cancel, log)


def job_run_id() -> str | None:
    """The flow run of the job calling (from a flow or a task of it): where the node launchers'
    worker lines are logged too, so the job's run tells its whole story."""
    from prefect.context import FlowRunContext, TaskRunContext

    flow_context = FlowRunContext.get()
    if flow_context is not None and flow_context.flow_run is not None:
        return str(flow_context.flow_run.id)
    task_context = TaskRunContext.get()
    return str(task_context.task_run.flow_run_id) if task_context is not None else None
