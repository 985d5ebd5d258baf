"""A pool's devices as a Prefect global concurrency limit: one slot per device.

The pool's controller creates the limit (`parashift-pool-{name}`, as many slots as the pool has
devices). Every segment of a job whose spec names the pool (`resources.pool`) holds as many
slots as it runs devices, from before its workers start until they have exited. So a job that
grows waits at its next launch until the job that shrinks for it has let go, and no run, started
by the pool or by hand, can hold more devices than the pool has. The slots are leases the holder
renews while it runs: a run killed with -9 gives them back within `LEASE_S`.

A pool over nodes has a limit per node instead (`parashift-pool-{name}-{node}`, the node's
devices): a segment holds its share of each of its nodes, all in one acquisition. So a job that
moves onto a node waits until the job leaving it has let go, which one pool-wide count would not
see (another job's slots, freed elsewhere, would do).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from parashift.specs import JobSpec
from parashift.specs.words import counted

LEASE_S = 60.0
WAIT_S = 900.0  # a job given devices that another job still holds waits this long for them


class PoolDevicesUnavailable(RuntimeError):
    """The pool's devices did not come free in time, or the pool has no limit."""


def pool_limit_name(pool: str) -> str:
    return f"parashift-pool-{pool}"


def node_limit_name(pool: str, node: str) -> str:
    return f"{pool_limit_name(pool)}-{node}"


def ensure_pool_limit(pool: str, devices: int, nodes: list[str] | None = None,
                      devices_per_node: int | None = None) -> None:
    """Create the pool's limit, or set it to the pool's device count; over nodes, each node's."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        if nodes is None:
            client.upsert_global_concurrency_limit_by_name(pool_limit_name(pool), devices)
        for node in nodes or []:
            client.upsert_global_concurrency_limit_by_name(node_limit_name(pool, node), devices_per_node or 1)


@contextlib.contextmanager
def pool_devices(spec: JobSpec, devices: int, wait_s: float = WAIT_S) -> Iterator[None]:
    """Hold `devices` of the spec's pool for the duration (nothing for a job outside a pool)."""
    pool = spec.resources.pool
    if pool is None:
        yield
        return
    from prefect.concurrency.sync import concurrency

    nodes = spec.resources.nodes
    name: str | list[str] = pool_limit_name(pool) if nodes is None else [node_limit_name(pool, n) for n in nodes]
    occupy = devices if nodes is None else (spec.resources.devices_per_node or 1)  # of each node
    try:
        held = concurrency(name, occupy=occupy, timeout_seconds=wait_s, lease_duration=LEASE_S, strict=True,
                           raise_on_lease_renewal_failure=False)  # a restarted server must not end training
        held.__enter__()
    except TimeoutError:
        raise PoolDevicesUnavailable(f"{spec.job_id}: {counted(devices, 'device')} of pool {pool} did not come free within "
                                     f"{wait_s:.0f} s (the concurrency limit {name!r})") from None
    except Exception as error:
        raise PoolDevicesUnavailable(f"{spec.job_id}: cannot hold devices of pool {pool} (the concurrency limit "
                                     f"{name!r}; is the pool's controller running?): {error}") from None
    try:
        yield
    finally:
        held.__exit__(None, None, None)
