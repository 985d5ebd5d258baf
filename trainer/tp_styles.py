"""Megatron's tensor-parallel region as ParallelStyles whose matmuls run on local shards.

Parameters are DTensors with the placements of torch's `ColwiseParallel` (an `nn.Linear`'s
weight and bias Shard(0)) and `RowwiseParallel` (input features sharded, bias Replicate; the
row-parallel linears are `InputMajorLinear`s, so their input features are dim 0: Shard(0)), so
checkpoints, the optimizer and gradient clipping see global tensors; communication is DTensor's
`redistribute`. What differs is the compute: torch's styles leave an `nn.Linear` multiplying
DTensors, and DTensor decomposes every linear into ~17 dispatched ops (view, t, addmm/mm, sum,
detach, forward and backward), each paying Python dispatch and sharding propagation. Measured
on bench/train_throughput's tp2 GPT on CPU: 588 DTensor dispatches per step, ~5% of the step.
Here each linear multiplies its parameters' local shards (`local_shard`: one autograd-aware
conversion per parameter), and the region's boundaries are Megatron's f and g operators
(Shoeybi et al. 2019, section 3) written with DTensor:

    f (region entry): stream layout -> replicated copy; backward reduces the partial input
                      gradients of every column-parallel linear in the region (once);
    g (row-parallel output): partial sums -> stream layout (all-reduce, or reduce-scatter
                      under sequence parallelism); backward passes the gradient through.

On a replicated stream f and g are single in-place all-reduces on the tp process group (as
Megatron writes them), not DTensor redistributions: measured on gloo, 2 ranks, a 2 MB
activation: 1.17 ms for `dist.all_reduce` against 1.89 ms for `from_local(Partial)
.redistribute(Replicate)` (DTensor's bookkeeping and functional collectives' copy), 24 times
per step. Under sequence parallelism (reduce-scatter / all-gather along T) DTensor does it.

The linears change class in place (as FSDP2's `fully_shard` does to the modules it wraps), so
parameter names, hooks and the module tree are untouched.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from parashift.models.layers import InputMajorLinear
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.parallel import ParallelStyle


def _shard_parameters(module: nn.Module, mesh: DeviceMesh, placements: dict[str, Placement]) -> None:
    for name, placement in placements.items():
        param = getattr(module, name, None)
        if param is not None:
            module.register_parameter(name, nn.Parameter(distribute_tensor(param.data, mesh, [placement])))


def _tp_partial(param: DTensor) -> tuple[Placement, ...]:
    """The placements of a replicated parameter's gradient when each tp rank saw part of the
    tokens: Partial on the tp axis, as it was elsewhere (the parameter may sit on a 2-D mesh)."""
    names = param.device_mesh.mesh_dim_names or ("tp",)
    return tuple(Partial() if name == "tp" else p for name, p in zip(names, param.placements, strict=True))


class _AllReduceForward(torch.autograd.Function):
    """Megatron's g on a replicated stream: sum the partial outputs in place; gradient as is."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _AllReduceBackward(torch.autograd.Function):
    """Megatron's f on a replicated stream: identity; the partial input gradients summed."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _LocalShard(torch.autograd.Function):
    """`param.to_local(grad_placements=...)` for a parameter, at less than half its cost.

    Why not `DTensor.to_local`: its backward rebuilds the gradient's spec (global strides, a
    copied DTensorSpec) and wraps the gradient through `DTensor.from_local`, itself an autograd
    Function with its own checks. Measured (bench/tp_boundary.py, the tp GPT's 72 parameters,
    forward + backward): 13.3 ms of conversions per step against 5.4 ms here. A parameter's local shard always has
    its parameter's strides (every split is on dim 0, docs/plans.md), so the gradient takes
    the parameter's spec as it is (or `grad_spec` for Partial gradients)."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, param: DTensor, grad_spec: DTensorSpec) -> torch.Tensor:
        ctx.grad_spec = grad_spec
        ctx.set_materialize_grads(False)
        local = param._local_tensor
        return local.view_as(local)  # a fresh tensor object: autograd writes its metadata there

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor | None) -> tuple[DTensor | None, None]:
        if grad is None:
            return None, None
        return DTensor(grad.contiguous(), ctx.grad_spec, requires_grad=False), None


def local_shard(param: DTensor, grad_placements: tuple[Placement, ...] | None = None) -> torch.Tensor:
    """This rank's shard of `param` as a plain tensor; its gradient arrives on `param` as a
    DTensor with `grad_placements` (default: the parameter's own)."""
    if torch.compiler.is_compiling():  # what dynamo traces: torch's own conversion
        return param.to_local(grad_placements=grad_placements)
    spec = param._spec
    if grad_placements is not None and tuple(grad_placements) != spec.placements:
        spec = DTensorSpec(spec.mesh, tuple(grad_placements), tensor_meta=spec.tensor_meta)
    return _LocalShard.apply(param, spec)


def _sum_partials(partial: torch.Tensor, mesh: DeviceMesh, layout: Placement) -> torch.Tensor:
    """g: this rank's partial sums -> the stream's layout (all-reduce or reduce-scatter)."""
    if isinstance(layout, Replicate):
        return _AllReduceForward.apply(partial, mesh.get_group())
    y = DTensor.from_local(partial, mesh, (Partial(),), run_check=False)
    return y.redistribute(mesh, (layout,)).to_local()


def _replicate_input(x: torch.Tensor, mesh: DeviceMesh, layout: Placement) -> torch.Tensor:
    """f: the stream (a local tensor in `layout`, or a DTensor) -> every rank's full copy."""
    if isinstance(layout, Replicate) and not isinstance(x, DTensor):
        return _AllReduceBackward.apply(x, mesh.get_group())
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, (layout,), run_check=False)
    return x.redistribute(mesh, (Replicate(),)).to_local(grad_placements=(Partial(),))


class _LocalColwiseLinear(nn.Linear):
    """Output features sharded: this rank's full input times its rows of the weight."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out / tp)
        bias = None if self.bias is None else local_shard(self.bias)
        return F.linear(x, local_shard(self.weight), bias)


class _LocalRowwiseLinear(InputMajorLinear):
    """Input features sharded: partial products summed over tp into the stream's layout."""

    tp_mesh: DeviceMesh
    output_layout: Placement

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, in / tp) -> (B, T, out) or (B, T / tp, out)
        y = _sum_partials(x @ local_shard(self.weight), self.tp_mesh, self.output_layout)
        if self.bias is None:
            return y
        # On a T chunk each rank's bias gradient covers its tokens only: a partial sum.
        sharded = isinstance(self.output_layout, Shard)
        return y + local_shard(self.bias, _tp_partial(self.bias) if sharded else None)


class LocalColwiseParallel(ParallelStyle):
    """Column-parallel `nn.Linear` (torch's ColwiseParallel placements): takes the region's
    replicated local input, returns this rank's output features as a local tensor."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        assert type(module) is nn.Linear, f"LocalColwiseParallel applies to nn.Linear, not {type(module)}"
        _shard_parameters(module, device_mesh, {"weight": Shard(0), "bias": Shard(0)})
        module.__class__ = _LocalColwiseLinear
        return module


class LocalRowwiseParallel(ParallelStyle):
    """Row-parallel `InputMajorLinear` (input features, its dim 0, sharded): takes local input
    features, returns the summed output in `output_layout` (Replicate, or Shard(1) for a
    sequence-parallel stream) as a local tensor."""

    def __init__(self, output_layout: Placement) -> None:
        super().__init__()
        self.output_layout = output_layout

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        assert type(module) is InputMajorLinear, f"LocalRowwiseParallel applies to InputMajorLinear, not {type(module)}"
        _shard_parameters(module, device_mesh, {"weight": Shard(0), "bias": Replicate()})
        module.__class__ = _LocalRowwiseLinear
        module.tp_mesh, module.output_layout = device_mesh, self.output_layout
        return module


class RegionEntry(ParallelStyle):
    """Megatron's f at a region's input: the stream (`input_layout`) becomes every rank's full
    local copy; in backward the partial input gradients, summed over the region's linears by
    autograd, are reduced once into the stream's layout."""

    def __init__(self, input_layout: Placement) -> None:
        super().__init__()
        self.input_layout = input_layout

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        layout = self.input_layout

        def enter(_module: nn.Module, args: tuple) -> tuple:
            return (_replicate_input(args[0], device_mesh, layout), *args[1:])

        module.register_forward_pre_hook(enter)
        return module
