"""The rank's process groups: joined from torchrun's (or a warm worker's) environment, left
together; and where every rank runs."""


from __future__ import annotations

import gc
import os
from typing import Any

import torch
import torch.distributed as dist
from parashift.specs import environ
from torch.distributed.constants import default_pg_timeout


def init_distributed(kind: str, choice: str = "auto") -> tuple[int, int, torch.device]:
    """Rank, world size and device from torchrun's environment (a single process without it),
    and the default process group: always one, so that every plan runs on a device mesh.
    `choice`: the spec's resources.backend (auto, or gloo for everything)."""
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if kind == "cuda":
        # More ranks than GPUs (a check of multi-rank code on one GPU) share them round-robin.
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    # On GPUs the default group carries CPU collectives too (gloo) beside NCCL's CUDA ones.
    # `backend` "gloo" (the spec's resources.backend): NCCL refuses two ranks on one GPU, gloo does not.
    backend = "cpu:gloo,cuda:nccl" if kind == "cuda" and choice == "auto" else "gloo"
    nccl = "nccl" in backend
    # A process started without torchrun has no rendezvous: it is a world of one, in memory. A
    # warm worker's job meets its peers under its own prefix of the pool's long-lived store.
    store = None if "MASTER_ADDR" in os.environ else dist.HashStore()
    prefix = os.environ.get(environ.STORE_PREFIX)
    if store is None and prefix:
        store = dist.PrefixStore(prefix, dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                                       is_master=False, timeout=default_pg_timeout))
    dist.init_process_group(backend=backend, device_id=device if nccl else None, store=store,
                            rank=rank if store else -1, world_size=world_size if store else -1)
    return rank, world_size, device


def end_distributed(world_size: int) -> None:
    """Leave the process groups together. The caller drops what holds them first (FSDP2's
    replicate and fully_shard state, pipeline stages), while the groups are still registered: a gloo group destroyed
    from the reducer's destructor joins its I/O thread while holding the GIL that thread waits
    for (a hang at exit with torch 2.13), and one left to interpreter exit aborts the process
    ("terminate called without an active exception")."""
    gc.collect()
    if world_size > 1:
        dist.barrier()
    dist.destroy_process_group()


def where_ranks_run(node: str, world_size: int, group: Any) -> tuple[list[int], list[str]]:
    """Every rank's process id and node, by rank: which process is which rank in the run log
    when one fails, and whose node-local tier holds which rank's objects (in each manifest)."""
    where: list[tuple[int, str]] = [(os.getpid(), node)]
    if world_size > 1:
        where = [(0, "")] * world_size
        dist.all_gather_object(where, (os.getpid(), node), group=group)
    return [p for p, _ in where], [n for _, n in where]
