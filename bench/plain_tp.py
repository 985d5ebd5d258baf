"""The tensor-parallel baseline: Megatron-LM's hand-written TP (Shoeybi et al. 2019, section 3)
on the same GPT, batch and optimizer as the trainer, in plain PyTorch (no DTensor): q/k/v and
up projections column-parallel, out and down projections row-parallel, Megatron's f/g
operators (identity forward / all-reduce backward at a region's entry, all-reduce forward /
identity backward at its exit); embeddings, norms and head replicated. Started by torchrun
from bench/train_throughput.py; reports per-step timings in the trainer's event format.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from parashift.models import family_of
from parashift.models.base import ModelFamily
from parashift.specs import JobSpec
from parashift.trainer import metrics
from parashift.trainer.data import load_tokens
from parashift.trainer.events import StepEvent
from torch import nn


class _CopyToRegion(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce of the input gradient backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous()
        dist.all_reduce(grad)
        return grad


class _ReduceFromRegion(torch.autograd.Function):
    """Megatron's g: all-reduce of the partial outputs forward, identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


class Region(nn.Module):
    """An attention or MLP block whose input enters a tensor-parallel region once."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(_CopyToRegion.apply(x))


class RowParallelLinear(nn.Module):
    def __init__(self, full: nn.Module, rank: int, tp: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(full.weight.detach().chunk(tp, dim=0)[rank].clone())  # (in / tp, out)
        self.bias = None if full.bias is None else nn.Parameter(full.bias.detach().clone())  # (out,), after the reduction

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _ReduceFromRegion.apply(x @ self.weight)  # (B, T, out)
        return y if self.bias is None else y + self.bias


def column_shard(linear: nn.Linear, rank: int, tp: int) -> None:
    """Keep this rank's rows of the weight (output features) and bias, in place."""
    linear.weight = nn.Parameter(linear.weight.detach().chunk(tp, dim=0)[rank].clone())  # (out / tp, in)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.detach().chunk(tp, dim=0)[rank].clone())  # (out / tp,)


def megatron(model: nn.Module, family: ModelFamily, rank: int, tp: int) -> set[int]:
    """Shard every layer's attention and MLP in place, Megatron's way, by hand (which modules
    are which comes from the family's sharding table); returns the ids of the sharded
    parameters (the others are replicated)."""
    table = family.sharding
    assert table is not None
    sharded: set[int] = set()
    for _, layer in family.layers(model):
        for region in table.regions:
            parent, _, name = region.module.rpartition(".")
            owner = layer.get_submodule(parent) if parent else layer
            inner = getattr(owner, name)
            for linear in region.colwise:
                column_shard(getattr(inner, linear), rank, tp)
                sharded |= {id(p) for p in getattr(inner, linear).parameters()}
            setattr(inner, region.rowwise, RowParallelLinear(getattr(inner, region.rowwise), rank, tp))
            sharded.add(id(getattr(inner, region.rowwise).weight))
            setattr(owner, name, Region(inner))
    return sharded


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", type=Path, required=True)
    spec = JobSpec.model_validate_json(parser.parse_args().spec.read_text())
    rank, tp = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    dist.init_process_group("gloo")
    torch.manual_seed(spec.training.seed)
    m = spec.model
    family = family_of(m)
    model = family.build(m)
    sharded = megatron(model, family, rank, tp)
    opt = spec.optimizer
    optimizer = torch.optim.AdamW(model.parameters(), lr=opt.lr, betas=tuple(opt.betas), eps=opt.eps, weight_decay=opt.weight_decay)
    tokens = torch.from_numpy(load_tokens(spec.data).astype("int64"))
    batch_size = spec.training.global_batch
    generator = torch.Generator().manual_seed(0)  # the same batch on every tp rank
    for step in range(1, spec.training.steps + 1):
        started = time.perf_counter()
        starts = torch.randint(0, len(tokens) - m.seq_len - 1, (batch_size,), generator=generator)
        batch = torch.stack([tokens[s : s + m.seq_len + 1] for s in starts.tolist()])  # (b, T + 1)
        logits = model(batch[:, :-1])  # (b, T, vocab)
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        if opt.grad_clip:  # the global norm: shard squares summed over ranks, replicas once
            params = [p for p in model.parameters() if p.grad is not None]
            shard_sq = torch.stack([p.grad.pow(2).sum() for p in params if id(p) in sharded]).sum()  # scalar
            dist.all_reduce(shard_sq)
            replica_sq = torch.stack([p.grad.pow(2).sum() for p in params if id(p) not in sharded]).sum()  # scalar
            torch.nn.utils.clip_grads_with_norm_(params, opt.grad_clip, (shard_sq + replica_sq).sqrt())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - started
        if rank == 0:
            tokens_per_step = batch_size * m.seq_len
            metrics.emit(StepEvent(step=step, loss=loss.item(), step_s=elapsed, tokens_per_s=tokens_per_step / elapsed))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
