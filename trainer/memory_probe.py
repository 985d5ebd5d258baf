"""One rank's peak memory over one training step of this trainer, measured without its peers.

Why: the planner's memory model is an estimate; this runs the trainer's own code (`build`:
meta build, pipeline stage, `parallelize`, `materialize`; the step as `train` runs it) for one
rank of a world of `plan.devices`, on torch's fake process group (collectives return at once,
no peers needed), and has torch's memory trackers (`torch.distributed._tools`) count every
storage the step holds: parameters, gradients, optimizer state (made by the first step, so
counted), activations, temporaries, FSDP's gathered parameters and collective buffers.
Under FakeTensorMode no memory is allocated at all, so a Llama 3 70B rank is measured on a
laptop; with `fake=False` the same step runs on real CPU tensors (values are meaningless on
the fake group, memory is real), which checks the fake run.
"""

from __future__ import annotations

import contextlib
import os
import time
import types
from collections import deque
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist
from parashift.models import family_of
from parashift.models.layers import token_loss_sum
from parashift.ptc import Slice
from parashift.specs import JobSpec
from parashift.specs.plan import Plan
from parashift.trainer.data import micro_batches, rank_share
from parashift.trainer.mesh import Coordinates, ParallelDims, forget_meshes
from parashift.trainer.optim import LocalShardAdamW
from parashift.trainer.parallel import (
    fsdp_mixed_precision,
    gradient_sync,
    loss_context,
    materialize,
    parallelize,
    plain,
    settle_gradients,
)
from parashift.trainer.pipeline import DEFAULT_SCHEDULE, build_stage
from parashift.trainer.worker import Built
from torch import nn
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.fsdp import FSDPModule

# The trackers' categories (mem_tracker._MemRefType, fsdp2_mem_tracker._FSDPRefType) -> ours.
CATEGORIES = {
    "Parameter": "params", "Sharded Param": "params", "Unsharded Param": "unsharded_params",
    "Buffer": "buffers", "Gradient": "grads", "Sharded Grad": "grads", "Unsharded Grad": "unsharded_grads",
    "Activation": "activations", "Temp": "temporaries", "Optstate": "optimizer", "OptState": "optimizer",
    "Other": "inputs", "Inputs": "inputs", "All Gather": "all_gather", "Reduce Scatter": "reduce_scatter",
}


def measure_step_peak(spec: JobSpec, plan: Plan, rank: int = 0, fake: bool = True) -> dict[str, float]:
    """Rank `rank`'s peak bytes over one step of `spec` under `plan` ("peak_bytes"), its
    breakdown at that peak (`CATEGORIES`' names, bytes) and the measurement's wall time
    ("seconds"). `fake`: under FakeTensorMode (no memory used; any model size) rather than on
    real CPU tensors. Owns the default process group while it runs: none may exist before."""
    started = time.perf_counter()
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=rank, world_size=plan.devices, store=FakeStore())
    try:
        dims = ParallelDims.from_plan(plan)
        mesh = dims.build_mesh("cpu")  # outside the fake mode: its coordinates are read as values
        coords = Coordinates.of(mesh, dims)
        mode: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        if fake:
            from torch._subclasses.fake_tensor import FakeTensorMode

            mode = FakeTensorMode(allow_non_fake_inputs=True)  # the mesh's tensors are real
        built = _build(spec, plan, dims, coords, mesh, mode)
        with mode:
            snapshot = _step_snapshot(spec, plan, built, dims, coords)
    finally:
        dist.destroy_process_group()
        forget_meshes()
    out: dict[str, float] = {"peak_bytes": 0.0}
    for device, categories in snapshot.items():
        if torch.device(device).type == "meta":
            continue
        for key, nbytes in categories.items():
            name = key.value if isinstance(key, Enum) else str(key)
            if name == "Total":
                out["peak_bytes"] += nbytes
            else:
                out[CATEGORIES.get(name, name)] = out.get(CATEGORIES.get(name, name), 0.0) + nbytes
    out["seconds"] = time.perf_counter() - started
    return out


def _build(spec: JobSpec, plan: Plan, dims: ParallelDims, coords: Coordinates, mesh: Any,
           mode: contextlib.AbstractContextManager[Any]) -> Built:
    """`trainer.worker.build`'s steps, with only the allocation (`materialize`, unfilled) and the
    optimizer under `mode`. Why not `build` inside FakeTensorMode: parameters made there on the
    meta device are fake tensors, some of which the mode's converter memoizes (a weak reference,
    depending on its dispatch cache), and `to_empty` then cannot swap them ("Cannot swap t1
    because it has weakref associated with it"). Built on the real meta device, as the worker
    builds, they are swapped for fake CPU tensors like any others."""
    m, device = spec.model, torch.device("cpu")
    family = family_of(m)
    with torch.device("meta"):
        model = family.build(m)
    n_params = sum(p.numel() for p in model.parameters())
    n_layers = len(list(family.layers(model)))
    regions = plan.tp_regions(n_layers)
    module = build_stage(model, family, plan, n_layers, coords.pp_rank) if dims.pp > 1 else model
    runnable = parallelize(module, family, plan, mesh, regions, device, compile=spec.parallelism.compile,
                           precision=spec.parallelism.precision)
    buffers = family.initial_buffers(m)  # real CPU values, computed outside the mode

    def initial_part(name: str, shape: tuple[int, ...], box: Slice) -> torch.Tensor:
        return family.initial_part(m, name, shape, box, spec.training.seed)

    with mode:
        materialize(module, device, initial_part, buffers, fill=False)  # allocated before the tracker starts
        optimizer = LocalShardAdamW(module, spec, device)
    return Built(family, module, runnable, optimizer, n_params, regions, initial_part)


def _step_snapshot(spec: JobSpec, plan: Plan, built: Built, dims: ParallelDims, coords: Coordinates) -> dict[Any, Any]:
    """One step of `built` under a tracker: the tracker's per-device, per-category snapshot at
    the step's peak."""
    device = torch.device("cpu")
    train = spec.training
    _, share = rank_share(train.global_batch, dims.dp, coords.dp_rank)
    if dims.pp > 1:  # the pipeline splits the share into plan.micro_batches equal micro-batches
        sizes = [share // plan.micro_batches] * plan.micro_batches
    else:  # as rank_batches splits it
        micro = train.micro_batch if plan.micro_batches == 1 else min(train.micro_batch, -(-share // plan.micro_batches))
        sizes = [size for _, size in micro_batches(share, micro)]
    seq, vocab = spec.model.seq_len, spec.model.vocab_size
    batches = [(torch.randint(0, vocab, (b, seq), device=device), torch.randint(0, vocab, (b, seq), device=device))
               for b in sizes]
    optimizer = built.optimizer.inner  # the torch optimizer the trackers hook
    tracker: MemTracker
    if plan.dp_shard > 1 and isinstance(built.module, FSDPModule):
        tracker = FSDPMemTracker(built.module, optimizer)
        tracker.track_inputs(tuple(batches))
    else:
        tracker = MemTracker()
        tracker.track_external(built.module, optimizer, *[t for batch in batches for t in batch])
    precision = spec.parallelism.precision
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16)
                if precision == "bf16" and not fsdp_mixed_precision(plan, precision) else contextlib.nullcontext())
    with tracker:
        if dims.pp > 1:
            with autocast:
                _pipelined_step(spec, built, batches, dims, coords, fsdp_mixed_precision(plan, precision))
        else:
            _step(spec, built, batches, dims, autocast)
        settle_gradients(list(built.module.parameters()))
        built.optimizer.step()
        built.optimizer.zero_grad()
    return tracker.get_tracker_snapshot("peak")


class _Call(nn.Module):
    """A fresh parent for each micro-batch's forward: both trackers refuse a root module called
    a second time in one tracked region (they take it for the next iteration)."""

    def __init__(self, built: Built) -> None:
        super().__init__()
        self.built = [built]  # not a submodule: the tracker names the model as the worker does

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        built = self.built[0]
        return built.family.logits(built.runnable, inputs)


def _step(spec: JobSpec, built: Built, batches: list[tuple[torch.Tensor, torch.Tensor]], dims: ParallelDims,
          autocast: contextlib.AbstractContextManager[Any]) -> None:
    """Forward and backward of every micro-batch, as `train` runs them without a pipeline."""
    scale = dims.dp / (spec.training.global_batch * spec.model.seq_len)
    loss_sum = torch.zeros(())
    calls = [_Call(built) for _ in batches]  # alive until the step ends: the trackers' backward hooks see them
    for i, (inputs, targets) in enumerate(batches):
        with gradient_sync(built.runnable, i == len(batches) - 1), loss_context(built.regions):
            with autocast:
                loss = token_loss_sum(calls[i](inputs), targets)
            (loss * scale).backward()
        loss_sum += plain(loss.detach()).float()


def _pipelined_step(spec: JobSpec, built: Built, batches: list[tuple[torch.Tensor, torch.Tensor]],
                    dims: ParallelDims, coords: Coordinates, bf16: bool) -> None:
    """This rank's stage over every micro-batch in the schedule's order, without its peers:
    a stage after the first is fed hidden states, one before the last a gradient for its output.
    1F1B keeps min(micro-batches, pp - stage) micro-batches' activations at once (GPipe all of
    them), and under FSDP or replicate every backward runs as torch.distributed.pipelining runs
    it: unsynced and unresharded, with the gradients reduced once at the end."""
    first, last = coords.pp_rank == 0, coords.pp_rank == dims.pp - 1
    schedule = os.environ.get("PARASHIFT_PP_SCHEDULE", DEFAULT_SCHEDULE)
    in_flight = len(batches) if schedule == "GPipe" else min(len(batches), dims.pp - coords.pp_rank)
    scale = dims.dp / (spec.training.global_batch * spec.model.seq_len)
    module, d_model = built.runnable, spec.model.d_model
    tokens = spec.model.seq_len // (dims.tp if built.regions.sequence else 1)  # the stream between stages
    fsdp = isinstance(module, FSDPModule)
    pending: deque[tuple[torch.Tensor, torch.Tensor | None]] = deque()
    calls = [_Call(built) for _ in batches]  # alive until the step ends: the trackers' backward hooks see them

    def backward() -> None:
        output, grad = pending.popleft()
        if fsdp:
            module.set_is_last_backward(False)
            module.set_reshard_after_backward(False)
            module.set_requires_gradient_sync(False)
        output.backward(grad)

    for call, (inputs, targets) in zip(calls, batches, strict=True):
        if not first:
            inputs = torch.randn(inputs.shape[0], tokens, d_model, dtype=torch.bfloat16 if bf16 else torch.float32,
                                 requires_grad=True)
        output = call(inputs)
        if last:
            output = token_loss_sum(output, targets) * scale
        pending.append((output, None if last else torch.ones_like(output)))
        if len(pending) == in_flight:
            backward()
    while pending:
        backward()
    if fsdp:  # pipelining's REDUCE_GRAD action, torch's own code
        from torch.distributed.pipelining.stage import _PipelineStageBase

        _PipelineStageBase.perform_reduce_grad(types.SimpleNamespace(submod=module), 1)  # type: ignore[arg-type]
