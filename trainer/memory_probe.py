"""One rank's peak memory over one training step of this trainer, measured without its peers.

Why: the planner's memory model is an estimate; this runs the trainer's own code (the steps of
`trainer.build.build`: meta build, pipeline stage, `parallelize`, `materialize`; then one step as
`Trainer.train_step` runs it, pipelines as torch.distributed.pipelining's 1F1B or GPipe holds them)
for one rank of a world of `plan.devices`, on torch's fake process group (collectives return at
once, no peers needed), and has torch's memory trackers (`torch.distributed._tools`) count every
storage the step holds: parameters, gradients, optimizer state (made by the first step, so
counted), activations, temporaries, FSDP's gathered parameters and collective buffers. Under
FakeTensorMode nothing is allocated, so a Llama 3 70B rank is measured in a few hundred MB of
host memory; with `fake=False` the same step runs on real CPU tensors (values are meaningless
on the fake group, memory is real), which checks the fake run (they agree to the byte).

Not measured: the allocator's caching and fragmentation (storages only), compiled layers (they
run eagerly under the trackers' dispatch mode), and the split between activations and
temporaries under activation checkpointing (torch's trackers document it as approximate; the
total is exact).
"""
from __future__ import annotations

import contextlib
import time
import types
from collections import deque
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist
from parashift.models.layers import token_loss_sum
from parashift.specs import JobSpec
from parashift.specs.plan import Plan
from parashift.trainer.build import Built, build
from parashift.trainer.data import micro_batches, rank_share
from parashift.trainer.mesh import Coordinates, ParallelDims, forget_meshes
from parashift.trainer.parallel import (
    clip_grad_norm_,
    fsdp_mixed_precision,
    gradient_sync,
    loss_context,
    plain,
    settle_gradients,
)
from torch import nn
from torch._guards import TracingContext, tracing
from torch._subclasses.fake_tensor import FakeTensorMode
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


def measure_step_peak(spec: JobSpec, plan: Plan, rank: int = 0, fake: bool = True,
                      device: str = "cpu") -> dict[str, float]:
    """Rank `rank`'s peak bytes over one step of `spec` under `plan` ("peak_bytes"), its
    breakdown at that peak (`CATEGORIES`' names, bytes) and the measurement's wall time
    ("seconds"). `fake`: under FakeTensorMode (no memory used; any model size) rather than on
    real tensors. `device` "cuda": real tensors on the current GPU, and the allocator's own
    peak over the measured step as well ("cuda_peak_bytes", what the caching allocator handed
    out; "cuda_reserved_bytes", what it held). Owns the default process group while it runs:
    none may exist before."""
    started = time.perf_counter()
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=rank, world_size=plan.devices, store=FakeStore())
    try:
        dims = ParallelDims.from_plan(plan)
        mesh = dims.build_mesh(device)  # outside the fake mode: its coordinates are read as values
        coords = Coordinates.of(mesh, dims)
        mode: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        if fake:
            mode = FakeTensorMode(allow_non_fake_inputs=True)  # the mesh's tensors are real
        # Built outside the fake mode, allocated under it. Why: parameters made on the meta device
        # inside FakeTensorMode are fake tensors the mode's converter may memoize (a weak
        # reference), and `to_empty` then cannot swap them ("Cannot swap t1 because it has
        # weakref associated with it").
        built = build(spec, plan, dims, coords, mesh, torch.device(device), allocate_in=mode)
        with mode:
            snapshot, allocator = _step_snapshot(spec, plan, built, dims, coords, fake, torch.device(device))
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
    out.update(allocator)
    out["seconds"] = time.perf_counter() - started
    return out


def _step_snapshot(spec: JobSpec, plan: Plan, built: Built, dims: ParallelDims, coords: Coordinates,
                   fake: bool, device: torch.device, steady: bool = True) -> tuple[dict[Any, Any], dict[str, float]]:
    """One step of `built` under a tracker: the tracker's per-device, per-category snapshot at
    the step's peak. FSDPMemTracker wherever FSDP2 holds the data axis (fully_shard, HSDP, and
    `replicate`, which is FSDP2 too: its breakdown shows replicate's second, unsharded copy of
    the parameters), MemTracker elsewhere; both count every storage alike. Under
    FakeTensorMode, DTensor's sharding propagation gets a fake mode of its own (a
    TracingContext's, which `detect_fake_mode` prefers): in ours, the trackers, which tell
    propagation from the step's ops by the fake mode they run in, would count its global-shape
    tensors (a tp step's peak read 4% high)."""
    feeds = _feeds(spec, plan, built, dims, coords, device)  # the step's data, there before it starts
    optimizer = built.optimizer.inner  # the torch optimizer the trackers hook
    precision = spec.parallelism.precision
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16)
                if precision == "bf16" and not fsdp_mixed_precision(plan, precision) else contextlib.nullcontext())

    def propagation() -> contextlib.AbstractContextManager[Any]:  # one per use: `tracing` is not re-entrant
        return tracing(TracingContext(FakeTensorMode())) if fake else contextlib.nullcontext()

    def one_step() -> None:
        kept: list[torch.Tensor] = []  # what outlives the forward and backward passes
        if dims.pp > 1:
            with autocast:
                kept = _pipelined_step(spec, built, feeds, dims, coords)
        else:
            _step(spec, built, feeds, dims, autocast)
        params = list(built.module.parameters())
        settle_gradients(params)
        # `train` takes the norm on every logged step, the first of a run among them (and clips with it)
        clip_grad_norm_(params, spec.optimizer.grad_clip or float("inf"), coords.within_stage())
        built.optimizer.step()
        built.optimizer.zero_grad()
        del kept

    if steady:  # a step before the measured one: its optimizer state exists, as on every step but the first
        with propagation():
            one_step()
    tracker: MemTracker  # made after that step: both trackers register the optimizer's state as they find it
    if isinstance(built.module, FSDPModule):
        tracker = FSDPMemTracker(built.module, optimizer)
        tracker.track_inputs(tuple(feeds))
    else:
        tracker = MemTracker()
        tracker.track_external(built.module, optimizer, *[t for feed in feeds for t in feed])
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    with tracker, propagation():
        one_step()
    allocator = {}
    if cuda:
        torch.cuda.synchronize(device)
        allocator = {"cuda_peak_bytes": float(torch.cuda.max_memory_allocated(device)),
                     "cuda_reserved_bytes": float(torch.cuda.max_memory_reserved(device))}
    return tracker.get_tracker_snapshot("peak"), allocator


def _feeds(spec: JobSpec, plan: Plan, built: Built, dims: ParallelDims,
           coords: Coordinates, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input, target) of each micro-batch of this rank's share, random token ids (B, T): as
    `rank_batches` splits the share, or in plan.micro_batches equal parts for a pipeline. A
    pipeline stage after the first takes (B, T', d) fp32 hidden states instead of ids (the
    stream its predecessor sends: T' = T / tp under sequence parallelism), and one before the
    last a gradient of that shape instead of targets: torch.distributed.pipelining holds a
    receive buffer of each, for every micro-batch, through the step."""
    train, m = spec.training, spec.model
    _, share = rank_share(train.global_batch, dims.dp, coords.dp_rank)
    if dims.pp > 1:
        sizes = [share // plan.micro_batches] * plan.micro_batches
    else:
        micro = train.micro_batch if plan.micro_batches == 1 else min(train.micro_batch,
                                                                        -(-share // plan.micro_batches))
        sizes = [size for _, size in micro_batches(share, micro)]
    stream = (m.seq_len // (dims.tp if built.regions.sequence else 1), m.d_model)
    first, last = coords.pp_rank == 0, coords.pp_rank == dims.pp - 1
    feeds = []
    with device:
        for b in sizes:
            ids = torch.randint(0, m.vocab_size, (b, m.seq_len))
            feeds.append((ids if first else torch.randn(b, *stream), ids.clone() if last else torch.ones(b, *stream)))
    return feeds


class _Call(nn.Module):
    """A fresh parent for each micro-batch's forward: both trackers refuse a root module called
    a second time in one tracked region (they take it for the next iteration)."""

    def __init__(self, built: Built) -> None:
        super().__init__()
        self.built = [built]  # not a submodule: the tracker names the model as the worker does

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        built = self.built[0]
        return built.family.logits(built.runnable, inputs)


def _step(spec: JobSpec, built: Built, feeds: list[tuple[torch.Tensor, torch.Tensor]], dims: ParallelDims,
          autocast: contextlib.AbstractContextManager[Any]) -> None:
    """Forward and backward of every micro-batch, as `train` runs them without a pipeline."""
    scale = dims.dp / (spec.training.global_batch * spec.model.seq_len)
    loss_sum = torch.zeros((), device=feeds[0][0].device)
    calls = [_Call(built) for _ in feeds]  # alive through the step: the trackers' backward hooks need them
    for i, (inputs, targets) in enumerate(feeds):
        with gradient_sync(built.runnable, i == len(feeds) - 1), loss_context(built.regions):
            with autocast:
                loss = token_loss_sum(calls[i](inputs), targets)
            (loss * scale).backward()
        loss_sum += plain(loss.detach()).float()


def _pipelined_step(spec: JobSpec, built: Built, feeds: list[tuple[torch.Tensor, torch.Tensor]],
                    dims: ParallelDims, coords: Coordinates) -> list[torch.Tensor]:
    """This rank's stage over every micro-batch in its schedule's order (`_feeds` stands in for
    its peers). 1F1B runs min(micro-batches, pp - stage) forwards before the first backward
    (GPipe all of them); under FSDP2 (fully_shard or replicate) each backward runs as
    torch.distributed.pipelining runs it, unsynced and unresharded, and the gradients are
    reduced once at the end by pipelining's own `perform_reduce_grad`. The last stage keeps no
    micro-batch's logits past its backward: `PipelineRunner.step` asks for no outputs
    (`return_outputs=False`). Returns what outlives the step (nothing)."""
    last = coords.pp_rank == dims.pp - 1
    schedule = spec.parallelism.pp_schedule
    in_flight = len(feeds) if schedule == "GPipe" else min(len(feeds), dims.pp - coords.pp_rank)
    scale = dims.dp / (spec.training.global_batch * spec.model.seq_len)
    module = built.runnable
    fsdp = isinstance(module, FSDPModule)
    pending: deque[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = deque()
    sent: list[torch.Tensor | None] = [None]  # the last input gradient, held until the next is sent
    calls = [_Call(built) for _ in feeds]  # alive through the step: the trackers' backward hooks need them

    def backward() -> None:
        inputs, output, grad = pending.popleft()
        if fsdp:
            module.set_is_last_backward(False)
            module.set_reshard_after_backward(False)
            module.set_requires_gradient_sync(False)
        output.backward(None if last else grad)
        sent[0], inputs.grad = inputs.grad, None

    held: torch.Tensor | None = None
    for i, (call, (inputs, target)) in enumerate(zip(calls, feeds, strict=True)):
        if inputs.is_floating_point():  # a received activation: its gradient goes back
            inputs = inputs.detach().requires_grad_(True)
        output = call(inputs)
        if last:
            output = token_loss_sum(output, target) * scale
        elif i == in_flight - 2:  # its send's Work holds it until 1F1B's last forward is done
            held = output
        pending.append((inputs, output, target))
        if len(pending) == in_flight:
            backward()
    del held
    while pending:
        backward()
    if fsdp:
        from torch.distributed.pipelining.stage import _PipelineStageBase

        _PipelineStageBase.perform_reduce_grad(types.SimpleNamespace(submod=module), 1)  # type: ignore[arg-type]
    return []
