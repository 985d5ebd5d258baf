"""The processes a job's segments run on, for as long as this process trains the job: its warm
workers (`resources.warm_workers`: they outlive each segment), or the forkserver its torchrun
workers fork from (this process's, shared by its launches).

    with job_workers(spec):                       # started now: their imports overlap the plan
        pool = warm_pool(spec, plan.devices)      # the job's pool, grown or shrunk by the launch
        ...                                       # ended with the block

Started when the job is taken rather than at its first launch, so that their imports (seconds
of a core each) overlap what comes before it (the Prefect API's start, the profile, the plan)
instead of delaying the first step. Jobs across nodes start theirs on their nodes."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from parashift.launcher.launch import start_forkserver
from parashift.launcher.warm_pool import WarmPool
from parashift.specs import JobSpec

# Warm workers of the jobs this process trains, by job id.
_warm_pools: dict[str, WarmPool] = {}
_warm_lock = threading.Lock()


@contextlib.contextmanager
def job_workers(spec: JobSpec) -> Iterator[None]:
    """For the duration: the job's workers on this node, started now (see the module)."""
    if spec.resources.nodes is None:
        if spec.resources.warm_workers:
            warm_pool(spec, spec.resources.devices)
        else:
            start_forkserver(spec.resources.kind)
    try:
        yield
    finally:
        with _warm_lock:
            pool = _warm_pools.pop(spec.job_id, None)
        if pool is not None:
            pool.close()


def warm_pool(spec: JobSpec, devices: int) -> WarmPool:
    """The job's warm pool (started with `devices` workers if it has none yet)."""
    with _warm_lock:
        if spec.job_id not in _warm_pools:
            _warm_pools[spec.job_id] = WarmPool(devices, spec.resources.kind, spares=spec.resources.warm_spares)
        return _warm_pools[spec.job_id]
