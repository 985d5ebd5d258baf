"""node_launcher: one node's share of a job's segment, run by that node's Prefect worker.

    meet the other nodes (node 0 publishes the rendezvous) -> torchrun this node's workers ->
    report to the job (in its storage)

Deployed as `node-launcher/parashift-node` (prefect.yaml); each node runs a worker of the
deployment's pool on the work queue named after the node, so the job's flow places each run on
its node (tasks/nodes.py). If that worker goes away mid-run, the node is leaving: its workers
are stopped at once and the report says so.
"""

from __future__ import annotations

import threading
import time

from parashift.launcher.launch import LaunchResult, RunningWorkers, run_measure_comm, start_forkserver
from parashift.launcher.segment import OutputTail, launch_segment
from parashift.specs import JobSpec
from parashift.specs.plan import Plan
from parashift.storage import LEASE_ENV, JobPaths, LeaseToken, open_store
from parashift.tasks.credentials import environment, storage_environment
from parashift.tasks.nodes import NodeReport, meet, stop_workers_when
from parashift.tasks.worker_log import WorkerLog, job_run_logger
from parashift.trainer.events import WorkerEvent
from prefect import flow
from prefect.logging import get_run_logger


@flow(name="node-launcher", flow_run_name="{spec.name}-{node}")
def node_launcher(spec: JobSpec, plan: Plan, launch_id: str, nodes: list[str], node: str,
                  until_step: int | None = None, measure_comm: bool = False,
                  lease_token: str | None = None, job_run_id: str | None = None) -> NodeReport:
    """Run this node's workers of the segment `launch_id` until they exit; report to the job.
    `measure_comm`: time collectives within and across the nodes instead of training (what the
    planner's communication model is fitted to). `job_run_id`: the job's flow run, whose log
    gets this node's worker lines too."""
    logger = get_run_logger()
    start_forkserver(spec.resources.kind)  # its imports overlap the wait for the other nodes
    job_log = job_run_logger(job_run_id)
    credentials = storage_environment(spec)
    with environment(credentials):
        store = open_store(spec.storage)
        rendezvous = meet(store, spec.job_id, launch_id, nodes, node)
    logger.info("node %s (%d of %d): rendezvous at %s:%d", node, rendezvous.node_rank, len(nodes),
                rendezvous.master_addr, rendezvous.master_port)

    def log(level: int, message: str) -> None:
        logger.log(level, "[%s] %s", node, message)
        job_log(level, f"[{node}] {message}")

    relay = WorkerLog(log, spec.training.steps)
    output = OutputTail(relay, prefix=f"[{node}] ")

    def stamp(event: WorkerEvent) -> None:
        event.received_at = time.time()  # when this node heard it (the job hears it later)

    workers, left = RunningWorkers(), threading.Event()
    try:
        if measure_comm:
            returncode, events, stderr = run_measure_comm(plan.devices, spec.resources.kind, rendezvous)
            for line in stderr.splitlines()[-20:] if returncode else []:
                output(line)
            result = LaunchResult(returncode=returncode, events=events)
        else:
            fenced = {**credentials, **({LEASE_ENV: str(LeaseToken.parse(lease_token))} if lease_token else {})}
            with environment(fenced), stop_workers_when(store, spec.job_id, launch_id, workers, left):
                result = launch_segment(spec, plan, until_step=until_step, node=rendezvous, on_line=output,
                                        on_event=stamp, extra_env=fenced, workers=workers)
    finally:
        relay.close()  # a failure report still being gathered
    if left.is_set():
        logger.warning("node %s: its worker went away; this node's workers were stopped (the node left)", node)
    report = NodeReport(node=node, returncode=result.returncode, events=result.events, hung_s=result.hung_s,
                        hang_suspects=result.hang_suspects, left=left.is_set(), tail=output.lines[-60:])
    with environment(credentials):
        store.put_json(JobPaths(spec.job_id).launch(launch_id, f"node-{node}"), report.model_dump(mode="json"))
    return report
