"""One running flow per job: two runs training into the same checkpoint folder (a schedule, a
form run and a retry at once) would prune each other's checkpoints.

A Prefect global concurrency limit named after the job, with one slot, created on first use.
The slot is a lease the holder renews while it runs, so a run that crashed frees it within
`LEASE_S`. A second run waits `WAIT_S` for the slot, then fails with a message that says why.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from prefect.client.orchestration import get_client
from prefect.concurrency.sync import concurrency

LEASE_S = 60.0
WAIT_S = 10.0


class JobAlreadyRunning(RuntimeError):
    """Another run of the same job holds its slot."""


def slot_name(job_id: str) -> str:
    return f"parashift-job-{job_id}"


@contextlib.contextmanager
def one_run_per_job(job_id: str, wait_s: float = WAIT_S) -> Iterator[None]:
    """Hold the job's only slot for the duration; JobAlreadyRunning when another run has it."""
    name = slot_name(job_id)
    with get_client(sync_client=True) as client:
        client.upsert_global_concurrency_limit_by_name(name, 1)
    with contextlib.ExitStack() as held:
        try:
            held.enter_context(concurrency(name, occupy=1, timeout_seconds=wait_s, lease_duration=LEASE_S, strict=True))
        except TimeoutError:
            raise JobAlreadyRunning(
                f"job {job_id} is already running in another flow run (the concurrency limit {name!r} holds its "
                f"one slot; waited {wait_s:.0f} s): this run trains nothing. Let that run finish, or stop it "
                "with `parashift stop`, then run again."
            ) from None
        yield
