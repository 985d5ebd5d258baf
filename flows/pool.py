"""pool_controller: a pool's devices divided among the jobs submitted to it, for as long as it runs.

    hold the pool's lease -> every tick: take submissions, read the jobs' runs and metrics ->
    on a pool event: allocate (pool.allocator) -> start runs, send resource events, preempt ->
    save the state, show the decision

The state lives in the pool's storage (`pool.state`), so a controller restarted, or started
again after a `kill -9`, goes on where the last one stopped; the runs it started go on without
it. The pool's devices are a Prefect global concurrency limit (`parashift-pool-{name}`) that
every segment of a pool job holds its devices of (tasks/pool_devices.py): no run, in the pool or
not, can take more than the pool has.
"""

from __future__ import annotations

import base64
import time
from typing import Any

import httpx
from parashift.pool.allocator import PoolPolicy
from parashift.pool.chart import allocation_png
from parashift.pool.controller import Action, PoolBook, Preempt, Resize, Start
from parashift.pool.state import pool_key, read_state, submissions, submit, write_state
from parashift.pool.step_times import Measured, counts_for, measured
from parashift.specs import JobSpec
from parashift.specs.pool import PoolSpec
from parashift.specs.words import counted
from parashift.storage import JobLease, JobPaths, ObjectStore, open_store
from parashift.tasks.artifacts import artifact_key
from parashift.tasks.pool_devices import ensure_pool_limit
from parashift.tasks.pool_jobs import predicted
from prefect import flow
from prefect.exceptions import PrefectHTTPStatusError
from prefect.logging import get_run_logger

# What a Prefect API that does not answer (a server restarting) raises: the tick is done again.
API_ERRORS = (httpx.HTTPError, PrefectHTTPStatusError, OSError)


@flow(name="pool-controller", flow_run_name="pool-{pool.name}")
def pool_controller(pool: PoolSpec, until_idle: bool = False, max_s: float | None = None) -> dict[str, Any]:
    """Run the pool: until stopped, or (`until_idle`) until every job submitted has ended (a
    controller started before the first submission waits for it: it used to end at once).
    Returns each job's status, submission, start and end times."""
    store = open_store(pool.storage)
    ensure_pool_limit(pool.name, pool.devices, pool.nodes, pool.devices_per_node)
    lease = JobLease(store, f"pool-{pool.name}", key=pool_key(pool.name, "lease.json"))
    with lease.hold():
        book = PoolBook(read_state(store, pool.name, pool.devices, pool.nodes, pool.devices_per_node),
                        PoolPolicy(horizon_s=pool.policy.horizon_s, aging_s=pool.policy.aging_s,
                                   mode=pool.policy.mode))
        deadline = time.monotonic() + max_s if max_s else None
        while True:
            lease.ensure()  # LeaseLost: another controller runs this pool now
            try:
                if tick(pool, store, book) and until_idle and book.state.jobs:  # none yet: wait for one
                    break
            except API_ERRORS as error:  # a Prefect server restarting: what was not done is done next tick
                get_run_logger().warning("pool %s: the Prefect API did not answer (%s); trying again in %.0f s",
                                         pool.name, " ".join(str(error).split())[:200], pool.tick_s)
            if deadline is not None and time.monotonic() > deadline:
                get_run_logger().warning("pool %s: stopping after %.0f s with %s", pool.name, max_s,
                                         "jobs still active" if book.state.jobs else "no job submitted")
                break
            time.sleep(pool.tick_s)
    return {job.job_id: job.model_dump(include={"status", "submitted_at", "started_at", "finished_at", "reason",
                                                "changes"}) for job in book.state.jobs.values()}


@flow(name="submit-to-pool", flow_run_name="submit-{spec.name}-to-{pool.name}")
def submit_to_pool(pool: PoolSpec, spec: JobSpec) -> str:
    """Queue a job in a pool (its controller takes it at its next look); the submission's key."""
    key = submit(open_store(pool.storage), pool.name, spec)
    get_run_logger().info("%s submitted to pool %s (%s)", spec.job_id, pool.name, key)
    return key


def tick(pool: PoolSpec, store: ObjectStore, book: PoolBook) -> bool:
    """One look at the pool: events, a decision if any, the actions it needs, the state saved.
    True when no job is active (and none was just submitted)."""
    logger = get_run_logger()
    events = [book.submitted(key, at, spec, lambda s: predicted(s, counts_for(s, pool.devices, pool.devices_per_node)))
              for key, at, spec in submissions(store, pool.name, set(book.state.submissions_seen))]
    if pool.nodes is not None:
        event = book.nodes_seen(online_nodes(pool))
        if event:
            events.append(event)
    seen: dict[str, Measured] = {}
    for job in book.state.active():
        if job.flow_run_id is None:
            continue
        ended = run_outcome(job.flow_run_id)
        if ended is not None:
            events.append(book.ended(job.job_id, *ended))
            continue
        try:
            seen[job.job_id] = measured(open_store(job.spec.storage), job.job_id)
        except Exception as error:  # a job's metrics unreadable now: read again next tick
            logger.warning("pool %s: cannot read %s's metrics: %s", pool.name, job.job_id, error)
            continue
        event = book.observed(job.job_id, seen[job.job_id])
        if event:
            events.append(event)
    if events:
        decision = book.allocate(events)
        logger.info("pool %s: %s -> %s", pool.name, decision.event,
                    ", ".join(f"{job} {n}" for job, n in decision.devices.items()) or "no active job")
        for job, why in decision.reasons.items():
            logger.info("  %s: %s", job, why)
    actions = book.actions(seen)
    if events or actions:
        write_state(store, book.state)  # the intent first: a controller killed while acting does it again
    for action in actions:
        act(pool, book, action)
    if actions:
        write_state(store, book.state)
    if events:
        show(pool, book)
    return book.idle()


def act(pool: PoolSpec, book: PoolBook, action: Action) -> None:
    """Start a job's run, tell a running job its devices, or ask it to stop."""
    logger = get_run_logger()
    match action:
        case Start(job_id=job_id, spec=spec):
            from prefect.deployments import run_deployment

            tags = [f"parashift-pool:{pool.name}", f"parashift-job:{job_id}"]
            run_id = live_run(tags)  # started by a controller killed before it saved the run's id
            if run_id is None:
                run_id = str(run_deployment(pool.deployment, timeout=0, flow_run_name=f"train-{job_id}",
                                            parameters={"spec": spec.model_dump(mode="json")}, tags=tags,
                                            as_subflow=False).id)
            book.state.jobs[job_id].flow_run_id = run_id
            res = spec.resources
            where = f"nodes {','.join(res.nodes)}" if res.nodes else counted(res.devices, 'device')
            logger.info("pool %s: %s runs on %s: flow run %s", pool.name, job_id, where, run_id)
        case Resize(job_id=job_id, devices=devices, before=before, nodes=nodes):
            from parashift.specs.elastic import ResourceEvent
            from parashift.tasks.events import emit_resource_change, now_epoch

            reason = "scale-up" if devices > before else "scale-down" if devices < before else "scale"
            change = ResourceEvent(devices=devices if nodes is None else None, nodes=nodes, epoch=now_epoch(),
                                   reason=reason)  # over nodes: the nodes alone say where
            emit_resource_change(job_id, change)
            logger.info("pool %s: told %s to run on %s (was %s)", pool.name, job_id, change.describe(),
                        counted(before, "device"))
        case Preempt(job_id=job_id, why=why):
            job_store = open_store(book.state.jobs[job_id].spec.storage)
            job_store.put_json(JobPaths(job_id).stop(), {"reason": f"pool {pool.name}: {why}",
                                                          "requested_at": time.time()})
            logger.info("pool %s: asked %s to stop: %s", pool.name, job_id, why)


def online_nodes(pool: PoolSpec) -> list[str]:
    """The pool's nodes whose worker (`node-NAME` of the node deployment's work pool, as
    docs/nodes.md starts them) Prefect says is online: it marks a worker offline once its
    heartbeats stop."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import WorkerStatus

    with get_client(sync_client=True) as client:
        work_pool = client.read_deployment_by_name(pool.node_deployment).work_pool_name
        workers = client.read_workers_for_work_pool(work_pool)
    online = {w.name for w in workers if w.status == WorkerStatus.ONLINE}
    return [node for node in pool.nodes or [] if f"node-{node}" in online]


def live_run(tags: list[str]) -> str | None:
    """A flow run with all of `tags` that has not ended, if there is one."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
        FlowRunFilterTags,
    )
    from prefect.client.schemas.objects import StateType

    live = [StateType.SCHEDULED, StateType.PENDING, StateType.RUNNING, StateType.PAUSED, StateType.CANCELLING]
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            tags=FlowRunFilterTags(all_=tags), state=FlowRunFilterState(type=FlowRunFilterStateType(any_=live))))
    return str(runs[0].id) if runs else None


def run_outcome(run_id: str) -> tuple[str, str | None] | None:
    """(finished | stopped | failed, why) once the run is over; None while it runs (or when the
    API cannot say now: asked again next tick)."""
    from prefect.client.orchestration import get_client

    try:
        with get_client(sync_client=True) as client:
            state = client.read_flow_run(run_id).state
    except Exception as error:
        get_run_logger().warning("cannot read flow run %s: %s", run_id, error)
        return None
    if state is None or not state.is_final():
        return None
    if state.is_completed():
        return ("stopped", None) if state.name == "Stopped" else ("finished", None)
    return "failed", " ".join((state.message or state.name).split())[:300]


def show(pool: PoolSpec, book: PoolBook) -> None:
    """The decision just made (what each job gets and why) and the allocations over time."""
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    state, last = book.state, book.state.decisions[-1]
    create_table_artifact(
        key=artifact_key(f"pool-{pool.name}", "decision"),
        table=[{"job": job, "devices": n, **({"nodes": ",".join(last.nodes.get(job, []))} if state.nodes else {}),
                "status": state.jobs[job].status, "why": last.reasons.get(job, "")}
               for job, n in last.devices.items()],
        description=f"pool {pool.name}, on: {last.event}")
    png = allocation_png(pool.name, pool.devices, state.decisions, time.time())
    create_markdown_artifact(key=artifact_key(f"pool-{pool.name}", "allocations"),
                             markdown=f"![devices per job in pool {pool.name}](data:image/png;base64,"
                                      f"{base64.b64encode(png).decode()})",
                             description=f"pool {pool.name}: devices per job over time")
