"""Apply a Plan to a family's single-device model with PyTorch's own machinery (torchtitan's
order): tensor/sequence parallelism through `parallelize_module` -> activation checkpointing
(trainer.recompute) -> optional compile -> the data axis (FSDP2, with its mixed-precision policy
where the Plan asks for it).

What "tp" splits comes from the Plan's `TensorParallel` (specs/plan.py), part by part; which
modules play each part comes from the family's sharding table (models/sharding.py):

    embed        table.embedding        vocab-parallel embedding (RowwiseParallel)
    sequence     layer norms, stream    sequence parallel (T chunks of the residual stream)
    attention    layers.i.<region>      Megatron attention (q/k/v colwise, output rowwise)
    mlp          layers.i.<region>      Megatron MLP (up/gate colwise, down rowwise)
    head         table.head             vocab-parallel head (+ loss_parallel)

A part not split runs replicated on every tp rank (the planner does choose this, e.g.
replicated attention with a tensor-parallel MLP).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from parashift.models.base import ModelFamily
from parashift.ptc import Slice
from parashift.ptc.dtensor import local_box, local_data
from parashift.specs.plan import Plan, TensorParallel
from parashift.trainer.mesh import data_mesh
from parashift.trainer.recompute import apply_ac
from parashift.trainer.tp_styles import LocalColwiseParallel, LocalRowwiseParallel, RegionEntry
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)


def _at(model: nn.Module, path: str) -> nn.Module | None:
    """The submodule at a dotted `path`; None where a pipeline stage removed it."""
    module: nn.Module | None = model
    for name in path.split("."):
        module = getattr(module, name, None)
        if module is None:
            return None
    return module


def apply_tp(model: nn.Module, family: ModelFamily, tp_mesh: DeviceMesh, choices: TensorParallel) -> None:
    """Shard a family's model (or a pipeline stage of it) over `tp_mesh` as `choices` say, in place.

    Activations between layers are local tensors: (B, T/tp, d) chunks under sequence
    parallelism, whole (B, T, d) otherwise; every region converts to and from that layout.
    A head tied to the embedding stays tied: both split the vocabulary (dim 0) or neither.
    """
    table = family.sharding
    assert table is not None, f"the {family.name} family has no sharding table"
    embedding, head = _at(model, table.embedding), _at(model, table.head)
    tied = embedding is not None and head is not None and head.weight is embedding.weight
    if tied and choices.embed != choices.head:
        raise ValueError("a head tied to the embedding must split the vocabulary with it, or neither")
    stream = Shard(1) if choices.sequence else Replicate()
    plan: dict[str, object] = {}
    if embedding is not None:
        if choices.embed:
            plan[table.embedding] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        if choices.sequence:  # embeddings summed whole; the stream is cut into T chunks here
            plan[table.stream_start] = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                                          use_local_output=True)
    for i, _ in family.layers(model):
        p = f"{table.layers}.{i}."
        if choices.sequence:
            plan.update({p + norm: SequenceParallel() for norm in table.layer_norms})
        for region in table.regions:
            if i in getattr(choices, region.part):  # trainer.tp_styles: Megatron's f and g, matmuls on local shards
                plan[p + region.module] = RegionEntry(stream)
                plan.update({p + f"{region.module}.{name}": LocalColwiseParallel() for name in region.colwise})
                plan[p + f"{region.module}.{region.rowwise}"] = LocalRowwiseParallel(stream)
            elif choices.sequence:
                plan[p + region.module] = ReplicatedRegion()
    if head is not None:
        if choices.sequence:
            plan[table.final_norm] = SequenceParallel()
        if choices.head:
            plan[table.head] = ColwiseParallel(
                input_layouts=stream,
                output_layouts=Shard(-1) if choices.loss_parallel else Replicate(),
                use_local_output=not choices.loss_parallel,
            )
        elif choices.sequence:
            plan[table.head] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                                  use_local_output=True)
    parallelize_module(model, tp_mesh, plan)
    if tied:  # each style distributed its own copy of the shared weight: share the embedding's again
        head.weight = embedding.weight


def _save_rng(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _restore_rng(device: torch.device, saved: tuple[torch.Tensor, torch.Tensor | None]) -> None:
    torch.set_rng_state(saved[0])
    if saved[1] is not None:
        torch.cuda.set_rng_state(saved[1], device)


def _seed_rank_stream(device: torch.device, tp_rank: int) -> None:
    """Switch to this tp rank's own stream: a seed drawn from the shared stream (the same draw
    on every tp peer, so the shared stream stays in step) plus the rank."""
    seed = int(torch.randint(0, 2**62, ()).item()) + tp_rank
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()].manual_seed(seed)


def apply_dropout_streams(model: nn.Module, family: ModelFamily, tp_rank: int, choices: TensorParallel,
                          device: torch.device) -> None:
    """Dropout that stays correct under tensor parallelism (Megatron's two RNG streams).

    Every tp peer seeds its default generator alike (the worker seeds by dp and pp coordinate),
    so dropout on activations replicated over tp draws the same mask on every peer: replicated
    parameters then receive the same gradients and never drift apart. Where a rank holds a
    shard of the activations (attention heads split over tp; the sequence-parallel stream), it
    switches to a stream of its own for that region, so shards draw independent masks.
    """
    def own_stream(module: nn.Module, until: nn.Module | None = None) -> None:
        """Dropout from `module`'s start to its end (or to the start of `until`) on the rank's stream."""
        saved: list[tuple[torch.Tensor, torch.Tensor | None]] = []

        def enter(_module: nn.Module, _args: object) -> None:
            saved.append(_save_rng(device))
            _seed_rank_stream(device, tp_rank)

        def leave(*_: object) -> None:
            if saved:
                _restore_rng(device, saved.pop())

        module.register_forward_pre_hook(enter)
        if until is None:
            module.register_forward_hook(leave)
        else:
            until.register_forward_pre_hook(leave)

    table = family.sharding
    assert table is not None
    for i, layer in family.layers(model):
        for region in table.regions:  # split activations inside a region (heads): up to its output linear
            if region.split_inside and i in getattr(choices, region.part):
                module = _at(layer, region.module)
                own_stream(module, until=getattr(module, region.rowwise))
        if choices.sequence:  # the residual stream is cut into T chunks: its dropouts draw per rank
            for path in table.stream_dropouts:
                own_stream(_at(layer, path))
    start = _at(model, table.stream_start)
    if choices.sequence and start is not None:
        own_stream(start)


class ReplicatedRegion(ParallelStyle):
    """A region replicated over tp inside a sequence-parallel stream: gather T on the way in,
    keep this rank's T chunk of the (identical) output on the way out."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True)
        scatter = PrepareModuleOutput(output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),), use_local_output=True)
        return scatter._apply(gather._apply(module, device_mesh), device_mesh)


def fsdp_mixed_precision(plan: Plan, precision: str) -> bool:
    """Whether FSDP2's mixed-precision policy gives this plan its bf16 compute (else autocast
    does, or nothing in fp32): asked for, in bf16, and a data axis for FSDP2 to hold it."""
    return precision == "bf16" and plan.mixed_precision == "fsdp" and plan.degree("dp") > 1


def mixed_precision_policies(enabled: bool) -> tuple[MixedPrecisionPolicy, MixedPrecisionPolicy]:
    """(per layer, at the root): bf16 parameters and compute, gradients reduced in fp32
    (torchtitan's default); the root hands fp32 logits to the loss. Disabled: parameters as held."""
    if not enabled:
        return MixedPrecisionPolicy(), MixedPrecisionPolicy()
    layer = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    root = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32)
    return layer, root


def apply_dp(model: nn.Module, family: ModelFamily, plan: Plan, mesh: DeviceMesh, bf16_params: bool = False) -> nn.Module:
    """The data axis: FSDP2's `replicate` (DDP semantics, DTensor-aware, so it composes with
    tensor parallelism and pipeline stages) when the state is replicated; `fully_shard` per
    block and at the root (torchtitan's order: each block's parameters gathered just before it
    runs) when it is sharded, over a 2-D (replicate, shard) mesh for HSDP. Both reduce
    gradients to their mean over the dp axis. `bf16_params`: FSDP2's mixed-precision policy
    (`mixed_precision_policies`); the fp32 parameters stay what the optimizer and checkpoints see."""
    layer_policy, root_policy = mixed_precision_policies(bf16_params)
    if plan.dp_shard == 1:
        from torch.distributed._composable.replicate_with_fsdp import replicate

        return replicate(model, mesh=data_mesh(mesh), mp_policy=root_policy)
    from torch.distributed.fsdp import fully_shard

    dp_mesh = mesh["dp_replicate", "dp_shard"] if plan.dp_replicate > 1 else mesh["dp_shard"]
    for _, layer in family.layers(model):
        fully_shard(layer, mesh=dp_mesh, reshard_after_forward=plan.reshard_after_forward, mp_policy=layer_policy)
    # The root's own parameters (embeddings, final norm, head) are gathered for the whole step.
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=False, mp_policy=root_policy)
    return model


def parallelize(model: nn.Module, family: ModelFamily, plan: Plan, mesh: DeviceMesh, regions: TensorParallel,
                device: torch.device, compile: bool = False, precision: str = "fp32", stage: int = 0) -> nn.Module:
    """The Plan applied to a family's `model` (or a pipeline stage of it, on `device` or still on
    the meta device): TP -> activation checkpointing -> compile -> data parallel (with FSDP2's
    mixed precision where `fsdp_mixed_precision`). `stage`: the pipeline stage `model` is (its
    checkpointing mode). Returns the module to call; parameters keep their names (checkpoints
    rely on that)."""
    if plan.degree("tp") > 1:
        apply_tp(model, family, mesh["tp"], regions)
        if any(m.p > 0 for m in model.modules() if isinstance(m, nn.Dropout)):
            apply_dropout_streams(model, family, mesh["tp"].get_local_rank(), regions, device)
    apply_ac([layer for _, layer in family.layers(model)], plan.ac_of_stage(stage))
    if compile:
        for _, layer in family.layers(model):
            layer.compile()  # per layer, as torchtitan does: small graphs, shared across layers
    if plan.degree("dp") > 1:
        model = apply_dp(model, family, plan, mesh, bf16_params=fsdp_mixed_precision(plan, precision))
    return model


# (parameter name, its global shape, this rank's box of it) -> the box's initial value, on the CPU
InitialPart = Callable[[str, tuple[int, ...], Slice], torch.Tensor]


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device, initial_part: InitialPart,
                buffers: dict[str, torch.Tensor] | None = None, *, fill: bool = True) -> None:
    """Give a model built on the meta device and parallelized there its memory on `device`, and
    fill each rank's part of every parameter from `initial_part(name, global shape, box)` (on
    the CPU), one parameter at a time (after torchtitan: build on meta, parallelize, then
    `to_empty` and initialise). FSDP2 re-pads its shards inside `to_empty`, so the local
    tensors written here are the ones it keeps. A parameter shared by two modules (a head tied
    to the embedding) stays shared: `to_empty` gives each module its own copy, so the ties are
    taken before and made again after. `buffers`: the values of buffers by name (`to_empty`
    leaves them uninitialised). `fill` False: the parameters' memory is left as `to_empty` gives
    it, for a caller that fills it itself (a restore; `initialize` where there is none)."""
    ties = _tied_parameters(model)
    model.to_empty(device=device)
    for module, name, owner, owner_name in ties:
        setattr(module, name, getattr(owner, owner_name))
    for name, buffer in model.named_buffers():
        if buffers and name in buffers:
            buffer.copy_(buffers[name])
    if fill:
        initialize(model, initial_part)


def _tied_parameters(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module, str]]:
    """(module, attribute, owner, owner's attribute) for every parameter a module shares with
    an earlier one."""
    first: dict[int, tuple[nn.Module, str]] = {}
    ties = []
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is None:
                continue
            if id(param) in first:
                ties.append((module, name, *first[id(param)]))
            else:
                first[id(param)] = (module, name)
    return ties


@torch.no_grad()
def initialize(model: nn.Module, initial_part: InitialPart) -> None:
    """Fill each rank's part of every parameter from `initial_part(name, global shape, box)`, in
    place (the parameters keep their memory: an optimizer built on them stays valid)."""
    for name, param in model.named_parameters():
        shape, box = local_box(param)
        local_data(param).copy_(initial_part(name, shape, box))


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Skip the data-parallel gradient reduction for all but the last micro-batch."""
    setter = getattr(model, "set_requires_gradient_sync", None)
    if setter is None:
        yield
        return
    setter(enabled)
    try:
        yield
    finally:
        setter(True)


def loss_context(choices: TensorParallel) -> contextlib.AbstractContextManager:
    """`loss_parallel` when the logits arrive vocab-sharded (forward and backward run inside)."""
    return loss_parallel() if choices.loss_parallel else contextlib.nullcontext()


def plain(tensor: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor result (a loss) as a plain tensor."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


# A flattened mesh axis stands for the axes it was made of (trainer.mesh builds "dp" so).
_MADE_OF = {"dp": ("dp_replicate", "dp_shard")}


def _first_replica(tensor: torch.Tensor, coords: dict[str, int]) -> bool:
    """Whether this rank holds the first copy of its box of `tensor`: its coordinate is 0 on
    every axis the box is replicated over (Replicate placements, and axes of `coords` that the
    tensor's mesh does not include at all). `coords`: this rank's coordinate on each axis of
    its pipeline stage ("dp_replicate", "dp_shard", "tp")."""
    covered: set[str] = set()
    if isinstance(tensor, DTensor):
        for name, placement in zip(tensor.device_mesh.mesh_dim_names or (), tensor.placements, strict=True):
            axes = _MADE_OF.get(name, (name,))
            covered.update(axes)
            if isinstance(placement, Replicate) and any(coords[a] for a in axes):
                return False
    return all(c == 0 for axis, c in coords.items() if axis not in covered)


@torch.no_grad()
def settle_gradients(params: list[torch.Tensor]) -> None:
    """Give every DTensor gradient its parameter's placements. Sequence-parallel norms leave
    Partial (unreduced) gradients (so do row-parallel biases on a sequence-parallel stream) and
    a vocab-parallel embedding a Replicate one; the optimizer steps local shards
    (trainer/optim.py) and the norm sums them, both of which need each gradient's local shard to
    be its parameter's box. One redistribution here makes it so."""
    for p in params:
        g = p.grad
        if isinstance(g, DTensor) and isinstance(p, DTensor) and g.placements != p.placements:
            p.grad = g.redistribute(p.device_mesh, p.placements)


@torch.no_grad()
def clip_grad_norm_(params: list[torch.Tensor], max_norm: float, coords: dict[str, int]) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ for parameters spread over a pp x dp x tp mesh, replicated
    or sharded: every distinct gradient box counted once (replicas skipped), squares summed over
    all ranks. Gradients must be settled (`settle_gradients`). `coords`: as `_first_replica`."""
    grads = [p.grad for p in params if p.grad is not None]
    total = local_grad_squares(params, coords)
    if dist.is_initialized():
        dist.all_reduce(total)
    norm = total.sqrt()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)  # torch's formula and epsilon
    torch._foreach_mul_([g.to_local() if isinstance(g, DTensor) else g for g in grads], coef)
    return norm


@torch.no_grad()
def local_grad_squares(params: list[torch.Tensor], coords: dict[str, int]) -> torch.Tensor:
    """This rank's part of the squared gradient norm (a scalar; summed over all ranks it is the
    norm squared): its distinct boxes only, one fused pass (torch's clip_grad_norm_ does the same)."""
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.zeros((), dtype=torch.float32, device=grads[0].device if grads else torch.device("cpu"))
    mine = [g.to_local() if isinstance(g, DTensor) else g for g in grads if _first_replica(g, coords)]
    if mine:
        total += torch.stack([n.float() for n in torch._foreach_norm(mine)]).pow(2).sum()
    return total
