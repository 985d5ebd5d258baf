"""Activation checkpointing of decoder layers: what each layer keeps for backward, and what it
recomputes instead (torchtitan's `apply_ac`, with torch's own machinery).

- "full": the layer keeps its input only; backward runs its forward again.
- "selective": the layer keeps the outputs of its matmuls, attention and collectives and
  recomputes the rest (norms, activations, dropout, rotary, residual adds, autocast's
  casts): torchtitan's per-op policy, which frees most of a layer's memory for a few percent
  of its FLOPs.

Applied with torch's composable `checkpoint` (hooks, not a wrapper module), so parameter names
stay as they are: checkpoints, layouts and the Hugging Face adapters never see a difference.
Recomputation restores the RNG state the forward saw (`preserve_rng_state`), so dropout draws
the same masks and a recomputed step is the same step (tests/test_recompute.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed._composable import checkpoint
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from torch.utils.checkpoint import checkpoint as torch_checkpoint

_aten = torch.ops.aten
_c10d = torch.ops._c10d_functional


def _saved_ops() -> frozenset[object]:
    """The ops whose outputs selective checkpointing keeps: every GEMM and attention kernel
    (CPU and CUDA variants) and the functional collectives tensor parallelism issues (so that
    backward never repeats a collective)."""
    names = [
        (_aten, "mm"), (_aten, "addmm"), (_aten, "bmm"), (_aten, "baddbmm"),
        (_aten, "_scaled_dot_product_flash_attention"), (_aten, "_scaled_dot_product_efficient_attention"),
        (_aten, "_scaled_dot_product_cudnn_attention"), (_aten, "_scaled_dot_product_flash_attention_for_cpu"),
        (_aten, "_flash_attention_forward"), (_aten, "_efficient_attention_forward"),
        (_c10d, "all_reduce"), (_c10d, "reduce_scatter_tensor"), (_c10d, "all_gather_into_tensor"),
        (_c10d, "all_to_all_single"),
    ]
    found = []
    for namespace, name in names:
        packet = getattr(namespace, name, None)
        if packet is not None:
            found.append(packet.default)
    return frozenset(found)


SAVED_OPS = _saved_ops()


def _ignore_profiler_records() -> None:
    """Have selective checkpointing ignore the profiler's record ops, as torch already does for
    other bookkeeping ops (`SAC_IGNORED_OPS`). FSDP2's mixed-precision input cast wraps itself
    in a profiler record only while a layer is recomputed, so the policy met an op in backward
    it never saw in forward and failed ("encountered during backward but not found in storage").
    torch has no per-policy way to say this: the set is torch's own."""
    from torch.utils.checkpoint import SAC_IGNORED_OPS

    for name in ("_record_function_enter", "_record_function_enter_new", "_record_function_exit"):
        packet = getattr(torch.ops.profiler, name, None)
        if packet is not None:
            SAC_IGNORED_OPS.update(getattr(packet, overload) for overload in packet.overloads())


_ignore_profiler_records()


def _keep_gemms(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts() -> tuple[object, object]:
    return create_selective_checkpoint_contexts(_keep_gemms)


# The modes that checkpoint a layer ("none" keeps everything autograd saves).
CHECKPOINTED = ("selective", "full")


def _options(mode: str) -> dict[str, Callable[[], tuple[object, object]]]:
    if mode not in CHECKPOINTED:
        raise ValueError(f"activation checkpointing {mode!r}: expected none, selective or full")
    return {"context_fn": _selective_contexts} if mode == "selective" else {}


def checkpoint_layer(layer: nn.Module, mode: str) -> None:
    """Apply `mode` ("none", "selective" or "full") to one decoder layer, in place."""
    if mode == "none":
        return
    checkpoint(layer, preserve_rng_state=True, **_options(mode))


def checkpointed_call(forward: Callable[..., object], mode: str, *args: object, **kwargs: object) -> object:
    """`forward(*args, **kwargs)` under the checkpoint `checkpoint_layer` applies for `mode`, for
    one call (what a measurement needs of several modes on one model: the composable checkpoint
    cannot be taken off a layer again)."""
    return torch_checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True, **_options(mode), **kwargs)


def apply_ac(layers: list[nn.Module], mode: str) -> None:
    """Checkpoint every decoder layer of a model (or of a pipeline stage) as `mode` says."""
    for layer in layers:
        checkpoint_layer(layer, mode)
