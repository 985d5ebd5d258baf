"""What a training step keeps in memory for its backward pass, measured.

`kept_for_backward` packs every tensor autograd saves (saved-tensor hooks) during one forward
of a family's model and counts each storage once (views share one), leaving out the parameters
themselves: the activation memory the planner's cost model must predict (planner/builders.py
`gpt_graph`, each op's `saved`). On a GPU, `torch.cuda.max_memory_allocated` around the same
forward checks it from the allocator's side (bench/activation_memory.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from parashift.models.layers import token_loss_sum
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def kept_for_backward(model: torch.nn.Module, tokens: torch.Tensor, targets: torch.Tensor, precision: str) -> int:
    """Bytes of the distinct storages autograd keeps for one forward and loss of `tokens`
    ((B, T) ids) under the trainer's `precision` ("bf16": autocast over fp32 weights)."""
    return sum(kept_parts(model, tokens, targets, precision))


def kept_parts(model: torch.nn.Module, tokens: torch.Tensor, targets: torch.Tensor, precision: str) -> tuple[int, int]:
    """`kept_for_backward` in two parts: (autocast's low-precision copies of the weights, once per
    forward whatever its batch, everything else)."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}
    # What autograd saved, held here until the forward is counted (alive, no storage's address
    # is reused by another). Why not in the graph (`pack` returning the tensor): a saved output
    # then refers to its own grad_fn, a cycle through C++ that Python's collector cannot see, and
    # the graph, the parameters with it, outlived the call (a 7B-wide layer copy is a gigabyte).
    held: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            kept[storage.data_ptr()] = storage.nbytes()
        held.append(tensor)

    def unpack(_: None) -> torch.Tensor:
        raise RuntimeError("kept_for_backward measures a forward; its graph is not for backward")

    autocast = (torch.autocast(tokens.device.type, dtype=torch.bfloat16) if precision == "bf16"
                else contextlib.nullcontext())
    with WeightCasts(weights) as casts, torch.autograd.graph.saved_tensors_hooks(pack, unpack), autocast:
        token_loss_sum(model(tokens), targets)
    held.clear()
    cast = sum(n for ptr, n in kept.items() if ptr in casts.made)
    return cast, sum(kept.values()) - cast


class WeightCasts(TorchDispatchMode):
    """Records the storages made by casting a weight (autocast's bf16 copy of each GEMM's
    weight): a forward makes them once, whatever its batch, so they are not per sequence."""

    def __init__(self, weights: set[int]) -> None:
        super().__init__()
        self.weights, self.made = weights, set[int]()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        if casts_a_weight(func, args, self.weights):
            self.made.add(out.untyped_storage().data_ptr())
        return out


def casts_a_weight(func: object, args: tuple[object, ...], weights: set[int]) -> bool:
    """Whether an op is autocast's cast of one of `weights` (storage addresses)."""
    return (func is torch.ops.aten._to_copy.default and isinstance(args[0], torch.Tensor)
            and args[0].untyped_storage().data_ptr() in weights)


def alive_after(forward: Callable[[], torch.Tensor]) -> int:
    """Bytes of the storages that `forward` (a forward pass and loss) created and that are
    still alive when it returns, the result's own left out: what backward will use, however it
    is held (autograd's saved tensors, an activation checkpoint's inputs, a selective policy's
    cache), so checkpointed layers are counted too, which saved-tensor hooks cannot see."""
    return sum(alive_parts(forward, set()))


def alive_parts(forward: Callable[[], torch.Tensor], weights: set[int]) -> tuple[int, int]:
    """`alive_after` in two parts: (casts of the storages `weights` names, everything else)."""
    created: dict[int, tuple[StorageWeakRef, int]] = {}
    before: set[int] = set()
    casts: set[int] = set()

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            for t in tree_leaves((args, kwargs)):  # parameters and inputs: there before, never counted
                if isinstance(t, torch.Tensor):
                    ptr = t.untyped_storage().data_ptr()
                    if ptr not in created or created[ptr][0].expired():
                        before.add(ptr)
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    storage = t.untyped_storage()
                    ptr = storage.data_ptr()
                    if ptr in before:  # a view of a parameter or an input (a transpose)
                        continue
                    if ptr not in created or created[ptr][0].expired():  # new, or a freed one's address reused
                        created[ptr] = (StorageWeakRef(storage), storage.nbytes())
                        if casts_a_weight(func, args, weights):
                            casts.add(ptr)
                        else:
                            casts.discard(ptr)
            return out

    with Record():
        result = forward()
    own = result.untyped_storage().data_ptr()
    alive = {ptr: n for ptr, (ref, n) in created.items() if ptr != own and not ref.expired()}
    cast = sum(n for ptr, n in alive.items() if ptr in casts)
    return cast, sum(alive.values()) - cast
