"""Activation checkpointing and FSDP2 mixed precision as graph transforms: what each op keeps,
recomputes and gathers under a plan's memory choices, so one cost model (costs.py) prices them.

Activation checkpointing of a layer (an op `block`, as the trainer checkpoints each decoder
layer: trainer/recompute.py):

- "full": the layer keeps its input only (what its first op reads from the stream); every op
  runs its forward again in backward.
- "selective" (torchtitan's per-op policy): GEMM and attention ops keep their outputs and are
  not recomputed; every other op (norms, activations, residual adds, autocast's casts) keeps
  nothing and is recomputed. The policy keeps collectives' outputs too: a column-parallel GEMM
  split over tp (q/k/v, the MLP's up projection) keeps its input as the sequence-parallel
  all-gather made it (`Op.gathered_input`; counted wherever the op splits over tp, also where
  the stream is not sequence-parallel and no gather happens: an overcount on the safe side).

Either way a checkpointed layer holds what it would have kept without checkpointing again
while its backward runs: one layer at a time (`Op.recomputed`, `Graph.recompute_layers`), and
autocast's weight copies are made again in that backward instead of held for the step. The
loss's logit gradients (`Op.transient`) are freed before the last layer is recomputed, so the
backward's peak holds the larger of the two (`Graph.recompute_share`).

Mixed precision "fsdp" (FSDP2's policy): parameters are gathered and used in bf16, so there are
no autocast copies to keep and a gather moves 2 bytes per element (autocast gathers the fp32
parameters themselves).
"""

from __future__ import annotations

from parashift.planner.graph import Graph, Op, Saved, recompute_share

MODES = ("none", "selective", "full")
GEMM_KINDS = frozenset({"matmul", "conv", "attention"})


def _kept(op: Op, graph: Graph) -> tuple[Saved, ...]:
    """What an op keeps without checkpointing (its `saved`, or its output at act_bytes)."""
    return op.saved if op.saved is not None else (Saved(dims=op.output, bytes=graph.act_bytes),)


def _layer_input(op: Op, graph: Graph) -> tuple[Saved, ...]:
    """A checkpointed layer's input, kept by its first op: at the element size that op keeps it
    at where it does (the fp32 stream under autocast), else act_bytes."""
    known = {s.dims: s.bytes for s in _kept(op, graph)}
    return tuple(Saved(dims=dims, bytes=graph.stream_bytes or known.get(dims, graph.act_bytes)) for dims in op.inputs[:1])


def _selective_keeps(op: Op, graph: Graph) -> tuple[Saved, ...]:
    """Under selective checkpointing: a GEMM's output; attention's outputs (its output and the
    per-row statistics it keeps beside its inputs, which are the GEMMs' outputs)."""
    if op.kind not in GEMM_KINDS:
        return ()
    out = [Saved(dims=op.gemm_output or op.output, bytes=graph.act_bytes)]
    if op.kind == "attention":
        out += [s for s in _kept(op, graph)
                if s.dims not in op.inputs and s.dims != op.output and graph.batch_dim in s.dims]
    return tuple(out)


def _shared(op: Op, graph: Graph) -> tuple[Saved, ...]:
    """Tensors an op keeps that have no batch dim (rotary tables): made once outside the layers
    and handed to each, so a checkpointed layer keeps them as its inputs."""
    return tuple(s for s in _kept(op, graph) if graph.batch_dim not in s.dims)


def _without(kept: tuple[Saved, ...], removed: tuple[Saved, ...]) -> tuple[Saved, ...]:
    left = list(kept)
    for s in removed:
        if s in left:
            left.remove(s)
    return tuple(left)


def checkpointed(graph: Graph, mode: str) -> Graph:
    """`graph` with every layer (op block) checkpointed as `mode` says."""
    if mode not in MODES:
        raise ValueError(f"activation checkpointing {mode!r}: expected one of {MODES}")
    blocks = {op.block for op in graph.ops if op.block is not None}
    if mode == "none" or not blocks:
        return graph
    seen: set[str] = set()
    ops = []
    for op in graph.ops:
        if op.block is None:
            ops.append(op)
            continue
        first = op.block not in seen
        seen.add(op.block)
        before = _kept(op, graph)
        inputs = (*(_layer_input(op, graph) if first else ()), *_shared(op, graph))
        if mode == "full":
            keeps, recompute = inputs, True
        else:
            keeps, recompute = (*inputs, *_selective_keeps(op, graph)), op.kind not in GEMM_KINDS
            gathered = op.kind == "matmul" and bool(op.tp_dims) and not any(
                d in t for d in op.tp_dims or () for t in op.inputs[:1])
            op = op.model_copy(update={"gathered_input": gathered})
        ops.append(op.model_copy(update={"saved": keeps, "recompute": recompute, "checkpointed": True,
                                         "recomputed": _without(before, keeps)}))
    return graph.model_copy(update={"ops": ops, "recompute_layers": len(blocks),
                                    "recompute_share": recompute_share(ops, len(blocks))})


def policy_on(mixed_precision: str | None, dp: int) -> str | None:
    """The bf16 policy a plan with `dp` data-parallel ranks computes under: FSDP2's needs a data
    axis to hold it, and without one the trainer runs autocast (trainer.parallel.fsdp_mixed_precision)."""
    return "autocast" if mixed_precision == "fsdp" and dp == 1 else mixed_precision


def with_precision(graph: Graph, mixed_precision: str) -> Graph:
    """`graph` (built for bf16 autocast, or fp32) under FSDP2's bf16 parameters ("fsdp"): no
    autocast weight copies, bf16 gathers. "autocast": weights gathered as held, in fp32."""
    if mixed_precision == "fsdp" and graph.act_bytes < 4:
        ops = [_with_bf16_parameters(op, graph) for op in graph.ops]
        return graph.model_copy(update={"ops": ops, "weight_cast_bytes": 0, "gather_bytes": graph.act_bytes,
                                        "stream_bytes": graph.act_bytes})
    return graph.model_copy(update={"gather_bytes": 4})


def _with_bf16_parameters(op: Op, graph: Graph) -> Op:
    """What an op keeps when parameters and the stream are bf16 (FSDP2's policy) instead of
    autocast's: a GEMM keeps its input once, not one autocast copy per linear; fp32
    activations (norm inputs and outputs) are bf16, except the loss's (the root hands it fp32
    logits). Measured against the real forward: within 13% per model (BENCHMARKS.md)."""
    if op.kind == "loss" or op.fp32_inside or op.saved is None:
        return op
    saved: list[Saved] = []
    for t in op.saved:
        if op.kind in GEMM_KINDS and t.dims in op.inputs and t in saved:
            continue  # autocast's second and third copies of the same input
        if t.bytes == 4 and graph.batch_dim in t.dims:
            t = Saved(dims=t.dims, bytes=graph.act_bytes)
        saved.append(t)
    return op.model_copy(update={"saved": tuple(saved)})
