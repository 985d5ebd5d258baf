"""One writer per job: two runs training into the same checkpoint folder (a schedule, a form run
and a retry at once, or two Prefect servers) would overwrite and prune each other's checkpoints.

Two guards, in this order:

1. `one_writer_per_job`: the job's lease in its storage (`storage.lease`), the one that counts.
   It holds for every writer of the store, whatever Prefect database started it; a crashed
   run's lease lapses by itself after its TTL; every manifest commit is fenced by its token,
   which reaches the workers through their environment (`storage.LEASE_ENV`).
2. `one_run_per_job`: a Prefect global concurrency limit named after the job, with one slot,
   created on first use: the run shows as holding it in the UI. The slot is a lease the holder
   renews while it runs; a second run waits `WAIT_S` for it, then fails with a message that
   says why. Its record lives in one Prefect database: the embedded API's outlives its process
   (a `parashift run` killed with -9 leaves it held, and no one renews or expires it). So a run
   that holds the storage lease, proof that every earlier holder is gone, frees a slot still
   held instead of waiting for it forever. It reads whether the slot is held before it takes
   it: a slot taken slowly is a loaded API, not a dead run (a 1 s try used to be read as
   one, and freed the slot with a warning that blamed a crashed run).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

from parashift.specs import JobSpec
from parashift.storage import LEASE_ENV, JobLease, JobLeaseHeld, open_store
from parashift.tasks.credentials import environment, storage_environment
from prefect.client.orchestration import get_client
from prefect.concurrency.sync import concurrency

LEASE_S = 60.0
WAIT_S = 10.0
# With the storage lease held, taking the slot waits for no other run, only for the API to
# answer (a loaded server took over 0.5 s, over 1 s with the suite running, and over 10 s as
# one server for three test workers): a run that holds the storage lease was taken first, so
# any other holder of the slot is stale or about to be refused by storage, and a long wait
# refuses no run that should train. A minute: the slot's own lease.
WAIT_WITH_LEASE_S = 60.0


class JobAlreadyRunning(RuntimeError):
    """Another run of the same job holds its slot (or, for a run holding the storage lease, the
    API did not grant the slot in time: the message says both)."""


def slot_name(job_id: str) -> str:
    return f"parashift-job-{job_id}"


def _logger() -> logging.Logger | logging.LoggerAdapter:
    from prefect.exceptions import MissingContextError
    from prefect.logging import get_run_logger

    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger("parashift.exclusive")


@contextlib.contextmanager
def one_writer_per_job(spec: JobSpec, ttl_s: float | None = None) -> Iterator[JobLease]:
    """Hold the job's storage lease for the duration (renewed in the background), its token in
    this process's environment (`LEASE_ENV`) for the workers it starts. JobLeaseHeld, at once
    and in one line, when another run holds it; LeaseLost on leaving when it was taken over."""
    with environment(storage_environment(spec)):
        store = open_store(spec.storage)
        lease = JobLease(store, spec.job_id, **({"ttl_s": ttl_s} if ttl_s else {}))
        with lease.hold() as token, environment({LEASE_ENV: str(token)}):
            yield lease


def running_elsewhere(spec: JobSpec) -> str | None:
    """Why another run of the job holds its storage lease live now (as `one_writer_per_job`
    would refuse), read without taking it; None where nothing does."""
    with environment(storage_environment(spec)):
        try:
            JobLease(open_store(spec.storage), spec.job_id).check_free()
        except JobLeaseHeld as held:
            return str(held)
    return None


@contextlib.contextmanager
def one_run_per_job(job_id: str, wait_s: float = WAIT_S, storage_lease: bool = False) -> Iterator[None]:
    """Hold the job's only slot for the duration; JobAlreadyRunning when another run has it.
    `storage_lease`: this run holds the job's storage lease, so whoever holds the slot is gone
    (crashed, or an embedded API's slot that outlived its process): the slot is freed, with
    one line, rather than waited for."""
    name = slot_name(job_id)
    with get_client(sync_client=True) as client:
        client.upsert_global_concurrency_limit_by_name(name, 1)
        if storage_lease and client.read_global_concurrency_limit_by_name(name).active_slots >= 1:
            from prefect.client.schemas.actions import GlobalConcurrencyLimitUpdate

            client.update_global_concurrency_limit(name, GlobalConcurrencyLimitUpdate(active_slots=0))
            _logger().warning("the concurrency limit %r was held by a run that no longer holds the job's storage "
                              "lease (it crashed, or its Prefect API went with its process): slot freed for this run", name)
    timeout_s = max(wait_s, WAIT_WITH_LEASE_S) if storage_lease else wait_s
    with contextlib.ExitStack() as held:
        try:
            held.enter_context(concurrency(name, occupy=1, timeout_seconds=timeout_s, lease_duration=LEASE_S, strict=True))
        except TimeoutError:
            if storage_lease:  # nothing tells a slot held by another run from an answer that came too late
                raise JobAlreadyRunning(
                    f"job {job_id}: the Prefect API did not grant the concurrency limit {name!r} within "
                    f"{timeout_s:.0f} s while this run holds the job's storage lease: another run "
                    "holds the slot, or the API is too loaded to answer in time; this run trains nothing") from None
            raise JobAlreadyRunning(
                f"job {job_id} is already running in another flow run (the concurrency limit {name!r} holds its "
                f"one slot; waited {wait_s:.0f} s): this run trains nothing. Let that run finish, or stop it "
                "with `parashift stop`, then run again."
            ) from None
        yield
