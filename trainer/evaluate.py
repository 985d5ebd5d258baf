"""The loss on held-out data (`training.eval_every`): the same number under any plan or device
count for the same weights.

The held-out set is fixed: the first `training.eval_samples` windows of the held-out tokens
(`data.eval_url`, or the documents `data.eval_share` keeps out of training), in order. Each
data-parallel rank takes its share (`rank_share`), tensor-parallel peers the same one; the sums
of token losses are added over ranks once per data-parallel share (as a step's report does) and
divided by the set's token count. A rank reads its share in chunks shaped as a training step's
share, as many on every rank (sharded parameters are gathered in each forward), padded with rows
whose targets are ignored (-100, which cross-entropy leaves out): a pipeline's stages keep the
shapes they were built for, and padding adds nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from parashift.models.layers import token_loss_sum
from parashift.specs import JobSpec
from parashift.trainer.data import SampleStream, rank_share, token_source
from parashift.trainer.mesh import Coordinates, ParallelDims
from parashift.trainer.parallel import loss_context, plain

IGNORED = -100  # F.cross_entropy's ignore_index


@dataclass
class HeldOut:
    """This rank's part of the held-out set."""

    stream: SampleStream
    windows: list[int]  # this rank's window indices
    chunk: int  # sequences per forward: a training step's share on this rank
    count: int  # forwards, the same on every rank (sharded parameters gather in each)
    tokens: int  # tokens in the whole held-out set, over every rank

    def chunks(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`count` (inputs, targets) of `chunk` rows each, padded with ignored rows."""
        out = []
        t = self.stream.seq_len
        for k in range(self.count):
            ids = [(0, i) for i in self.windows[k * self.chunk:(k + 1) * self.chunk]]
            rows = self.stream.windows(ids) if ids else torch.zeros((0, t + 1), dtype=torch.int64)
            inputs, targets = rows[:, :-1], rows[:, 1:].clone()
            missing = self.chunk - len(ids)
            if missing:
                inputs = torch.cat([inputs, torch.zeros((missing, t), dtype=inputs.dtype)])
                targets = torch.cat([targets, torch.full((missing, t), IGNORED, dtype=targets.dtype)])
            out.append((inputs, targets))
        return out


def held_out(spec: JobSpec, dims: ParallelDims, coords: Coordinates, share_count: int) -> HeldOut | None:
    """This rank's held-out windows, or None when the spec evaluates nothing."""
    if spec.training.eval_every is None:
        return None
    stream = SampleStream(token_source(spec.data, spec.training.seed, held_out=True), spec.model.seq_len,
                          spec.training.seed)
    total = min(spec.training.eval_samples, stream.samples_per_epoch)
    offset, count = rank_share(total, dims.dp, coords.dp_rank)
    # the most windows any rank has, in chunks of the smallest share any rank trains with
    forwards = math.ceil(math.ceil(total / dims.dp) / (spec.training.global_batch // dims.dp))
    return HeldOut(stream, list(range(offset, offset + count)), share_count, forwards, total * spec.model.seq_len)


def evaluate(data: HeldOut, built: Any, pipeline: Any, autocast: Any, coords: Coordinates, dims: ParallelDims,
             device: torch.device, world_size: int) -> float:
    """The mean token loss over the held-out set (every rank calls it: it ends in an all-reduce)."""
    built.module.eval()  # no dropout
    loss_sum = torch.zeros((), device=device, dtype=torch.float64)
    try:
        with torch.no_grad():
            for inputs, targets in data.chunks():
                loss_sum += _chunk_loss(built, pipeline, autocast, inputs.to(device), targets.to(device))
    finally:
        built.module.train()
        _reshard(built.module)
    counts = coords.tp_rank == 0 and coords.pp_rank == dims.pp - 1  # once per data-parallel share
    total = loss_sum if counts else torch.zeros_like(loss_sum)
    if world_size > 1:
        dist.all_reduce(total)
    return total.item() / data.tokens


def _chunk_loss(built: Any, pipeline: Any, autocast: Any, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """One forward of a chunk (no activations are kept for a backward: a whole share at once)."""
    with autocast:
        if pipeline is not None:
            return pipeline.evaluate(inputs, targets).double()
        with loss_context(built.regions):
            loss = token_loss_sum(built.family.logits(built.runnable, inputs), targets)
    return plain(loss.detach()).double()


def _reshard(module: torch.nn.Module) -> None:
    """FSDP2 modules back to their sharded parameters: a forward without a backward (no
    post-backward hook runs) leaves the root's gathered ones in place, and the next step's
    backward then fails to free them."""
    from torch.distributed.fsdp import FSDPModule

    for part in module.modules():
        if isinstance(part, FSDPModule):
            part.reshard()
