"""This rank's data and model under the Plan: its share of every global batch, and its part of
the model built on the meta device, parallelized, then allocated."""


from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from parashift.models import family_of
from parashift.models.base import ModelFamily
from parashift.ptc import Slice
from parashift.specs import JobSpec
from parashift.specs.plan import Plan
from parashift.trainer.data import (
    Prefetcher,
    SampleStream,
    micro_batches,
    rank_share,
    token_source,
)
from parashift.trainer.mesh import Coordinates, ParallelDims
from parashift.trainer.optim import LocalShardAdamW
from parashift.trainer.parallel import (
    materialize,
    parallelize,
)
from parashift.trainer.pipeline import build_stage


@dataclass
class Batches:
    """This rank's data: the global sample stream every rank builds alike, and its share of
    each global batch (tensor-parallel peers take the same share)."""

    stream: SampleStream
    share_offset: int
    share_count: int
    micros: list[tuple[int, int]]  # (offset in the share, size) of each micro-batch

    def prefetcher(self, global_batch: int, pipelined: bool) -> Prefetcher:
        """A reader of this rank's batches, step after step: the whole share for a pipeline
        (which splits it itself), else each micro-batch."""
        requests = [(0, self.share_count)] if pipelined else self.micros
        return Prefetcher(self.stream, self.share_offset, requests, global_batch)


def rank_batches(spec: JobSpec, plan: Plan, dims: ParallelDims, coords: Coordinates) -> Batches:
    train = spec.training
    source = token_source(spec.data)
    ends = source.document_ends() if spec.data.samples == "documents" else None  # type: ignore[attr-defined]
    stream = SampleStream(source, spec.model.seq_len, train.seed, document_ends=ends)
    share_offset, share_count = rank_share(train.global_batch, dims.dp, coords.dp_rank)
    # The spec's micro-batch size, or smaller where the plan asks for more micro-batches
    # (gradient accumulation to cut activation memory; pipelines split the share themselves).
    micro_size = train.micro_batch if plan.micro_batches == 1 else min(train.micro_batch, -(-share_count // plan.micro_batches))
    return Batches(stream, share_offset, share_count, micro_batches(share_count, micro_size))


@dataclass
class Built:
    """This rank's part of the model under the Plan, allocated; its values come from the restore,
    or from `initial_part` where there is nothing to restore (`restore`)."""

    family: ModelFamily
    module: torch.nn.Module  # this rank's stage (the whole model without "pp"), parallelized
    runnable: torch.nn.Module  # what the forward pass calls (compiled, where the spec asks)
    optimizer: LocalShardAdamW
    n_params: int  # of the whole model
    regions: Any  # the plan's tensor-parallel regions
    initial_part: Callable[[str, tuple[int, ...], Slice], torch.Tensor]  # a box's initial values, the same under any plan


def build(spec: JobSpec, plan: Plan, dims: ParallelDims, coords: Coordinates, mesh: Any, device: torch.device,
          allocate_in: contextlib.AbstractContextManager[Any] | None = None) -> Built:
    """Built on the meta device (no memory), cut to this rank's stage, the Plan applied, then
    only this rank's parts allocated. Not filled: a job that resumes overwrites every value
    (the restore reads into the parameters in place), so drawing the initial weights first
    would cost every change of device count that CPU time (the weights of every rank's part
    drawn and copied, 0.1-0.2 s a rank here) for nothing. `restore` fills what it does not
    restore. `allocate_in`: a mode only the allocation and the optimizer run under
    (trainer.memory_probe's FakeTensorMode: the model must be built outside it)."""
    m = spec.model
    family = family_of(m)
    model = family.build_on_meta(m)
    n_params = sum(p.numel() for p in model.parameters())
    n_layers = len(list(family.layers(model)))
    regions = plan.tp_regions(n_layers)
    module = build_stage(model, family, plan, n_layers, coords.pp_rank) if dims.pp > 1 else model
    runnable = parallelize(module, family, plan, mesh, regions, device, compile=spec.parallelism.compile,
                           precision=spec.parallelism.precision, stage=coords.pp_rank)

    def initial_part(name: str, shape: tuple[int, ...], box: Slice) -> torch.Tensor:
        return family.initial_part(m, name, shape, box, spec.training.seed)

    buffers = family.initial_buffers(m)  # real CPU values, outside `allocate_in`
    with allocate_in or contextlib.nullcontext():
        materialize(module, device, initial_part, buffers, fill=False)
        optimizer = LocalShardAdamW(module, spec, device)
    return Built(family, module, runnable, optimizer, n_params, regions, initial_part)
