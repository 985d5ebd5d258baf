"""The few CPU collectives saves and restores agree through (on the checkpoint's own gloo
group: it works beside an NCCL-only training group, and from the saver's thread)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

Group = Any  # a torch.distributed ProcessGroup, or None for a single process


def broadcast(value: Any, group: Group, src: int = 0) -> Any:
    if group is None:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def agree_lowest(verdict: int, group: Group) -> int:
    """The lowest verdict of all ranks (a CPU collective on the gloo group: it also works where
    the training group is NCCL-only)."""
    if group is None:
        return verdict
    flag = torch.tensor([verdict], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return int(flag.item())
