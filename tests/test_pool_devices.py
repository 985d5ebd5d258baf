"""A pool's devices as Prefect global concurrency limits (`tasks.pool_devices`), on a real
Prefect server: over nodes, a segment holds its share of each of its nodes, so a job cannot move
onto a node before the job there has let go, while another node stays free to take."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from parashift.specs import JobSpec
from parashift.tasks.pool_devices import (
    PoolDevicesUnavailable,
    ensure_pool_limit,
    node_limit_name,
    pool_devices,
)


def on_nodes(name: str, nodes: list[str]) -> JobSpec:
    return JobSpec.model_validate({"name": name, "resources": {"nodes": nodes, "devices_per_node": 2,
                                                               "pool": "nodes-pool"}})


def test_a_segment_holds_its_share_of_each_of_its_nodes(prefect_server: None) -> None:
    from prefect.client.orchestration import get_client

    ensure_pool_limit("nodes-pool", 6, ["a", "b", "c"], 2)
    with pool_devices(on_nodes("first", ["a", "b"]), 4):
        with get_client(sync_client=True) as client:
            held = {n: client.read_global_concurrency_limit_by_name(node_limit_name("nodes-pool", n)).active_slots
                    for n in "abc"}
        assert held == {"a": 2, "b": 2, "c": 0}
        with pytest.raises(PoolDevicesUnavailable, match="did not come free"), \
                pool_devices(on_nodes("second", ["b", "c"]), 4, wait_s=1.0):
            pass
        with pool_devices(on_nodes("third", ["c"]), 2, wait_s=5.0):
            pass
    with pool_devices(on_nodes("second", ["b", "c"]), 4, wait_s=5.0):  # let go: b is free now
        pass
    with get_client(sync_client=True) as client:
        assert all(client.read_global_concurrency_limit_by_name(node_limit_name("nodes-pool", n)).active_slots == 0
                   for n in "abc")


def test_a_controller_until_idle_waits_for_its_first_job(prefect_server: None, tmp_path: Path) -> None:
    """`parashift pool --until-idle` started before any submission (as docs/pool.md shows) waits
    for one instead of ending at its first look (it did: found by using it)."""
    from parashift.flows.pool import pool_controller
    from parashift.specs.pool import PoolSpec

    pool = PoolSpec.model_validate({"name": "empty", "devices": 2, "storage": {"url": f"file://{tmp_path}/store"},
                                    "tick_s": 0.2})
    began = time.monotonic()
    assert pool_controller(pool, until_idle=True, max_s=2.0) == {}
    assert time.monotonic() - began >= 2.0  # it looked until its deadline, not once
