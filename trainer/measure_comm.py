"""A torchrun program that times collectives and point-to-point sends on the job's own workers
and reports the timings as one worker event; the planner fits its communication model to them
(`planner.comm.comm_model_from_timings`).

    torchrun --standalone --nproc-per-node N -m trainer.measure_comm --kind cpu

Across nodes (launched by each node's launcher, `PARASHIFT_NODES` set) it times both levels:
within a node and between nodes.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import torch
import torch.distributed as dist
from parashift.specs import environ
from parashift.trainer import metrics
from parashift.trainer.distributed import init_distributed
from parashift.trainer.events import CommTimingsEvent


def time_collectives(group: Any = None, sizes: tuple[int, ...] = (1 << 14, 1 << 18, 1 << 22),
                     repeats: int = 3) -> dict[str, Any]:
    """Best-of-`repeats` seconds of all_reduce, all_gather and a ring of point-to-point sends
    (every rank sends to the next and receives from the previous at once, as pipeline stages
    do) for each message size, slowest rank: `{"group_size": g, "all_reduce": [[bytes, s],
    ...], "all_gather": [...], "p2p": [...]}`. Call it on every rank of the group."""
    g = dist.get_world_size(group)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")
    rank = dist.get_rank(group)

    def peer(k: int) -> int:  # global rank of the group member k places on
        local = (rank + k) % g
        return dist.get_global_rank(group, local) if group is not None else local

    to_next, from_prev = peer(1), peer(-1)

    def shift(x: torch.Tensor, y: torch.Tensor) -> None:
        if g < 2:
            return
        ops = [dist.P2POp(dist.isend, x, to_next, group), dist.P2POp(dist.irecv, y, from_prev, group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    def best_of(fn: Any) -> float:
        best = float("inf")
        for _ in range(repeats):
            dist.barrier(group=group)
            started = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - started)
        return best

    kinds = ("all_reduce", "all_gather", "p2p")
    seconds: dict[str, list[float]] = {kind: [] for kind in kinds}
    for size in sizes:
        x = torch.ones(size // 4, dtype=torch.float32, device=device)
        y = torch.empty_like(x)
        out = [torch.empty_like(x) for _ in range(g)]
        dist.all_reduce(x, group=group)  # warm-up (connects, allocates)
        dist.all_gather(out, x, group=group)
        shift(x, y)
        seconds["p2p"].append(best_of(lambda: shift(x, y)))  # noqa: B023 (called at once)
        seconds["all_reduce"].append(best_of(lambda: dist.all_reduce(x, group=group)))  # noqa: B023
        seconds["all_gather"].append(best_of(lambda: dist.all_gather(out, x, group=group)))  # noqa: B023
    slowest = torch.tensor([t for kind in kinds for t in seconds[kind]], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)  # every rank reports the same timings
    n = len(sizes)
    timings: dict[str, Any] = {"group_size": g}
    for i, kind in enumerate(kinds):
        timings[kind] = [[size, float(t)] for size, t in zip(sizes, slowest[i * n:(i + 1) * n], strict=True)]
    return timings


def time_levels(nodes: int, per_node: int, rank: int) -> dict[str, Any]:
    """A job across nodes (node-major ranks): collectives within a node (every node's ranks at
    once, as tensor-parallel groups run) and across nodes (one rank per node), the two levels
    of the planner's communication model. Call it on every rank."""
    # Every rank creates every group, in the same order (torch.distributed's rule).
    within = [dist.new_group(list(range(n * per_node, (n + 1) * per_node))) for n in range(nodes)]
    across = dist.new_group([n * per_node for n in range(nodes)])
    intra = time_collectives(within[rank // per_node]) if per_node > 1 else None
    inter = time_collectives(across) if rank % per_node == 0 else None
    return {"group_size": nodes * per_node, "nodes": nodes, "devices_per_node": per_node, "intra": intra, "inter": inter}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--kind", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args(argv)
    rank, world_size, _ = init_distributed(args.kind)
    if world_size < 2:
        raise SystemExit("measuring collectives needs at least 2 workers")
    nodes = [n for n in os.environ.get(environ.NODES, "").split(",") if n]  # set by a launch across nodes
    if len(nodes) > 1:
        timings = time_levels(len(nodes), world_size // len(nodes), rank)
    else:
        timings = time_collectives()
    if rank == 0:
        metrics.emit(CommTimingsEvent(timings=timings))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
