"""The planner's graph of a Llama job (imported by the planner's side only).

The GPT's module-level graph (planner/builders.py `gpt_graph`) with Llama's parts: RMSNorm,
SwiGLU, and grouped-query attention written over kv groups: "h" counts key/value heads, each
with "r" query heads, so splitting "h" over tp is exactly what the trainer does (kv heads split,
each query head kept with its group's), and r = 1 is multi-head attention. Each op's `saved` is
what autograd keeps for models/llama/model.py as the trainer runs it (tests/test_llama_planner.py
measures it): RMSNorm keeps its fp32 input, the normalised input and one statistic per token;
under bf16 each projection casts its own copy of its input; attention keeps rotated q and k, v,
its output and one log-sum-exp per query head; SwiGLU keeps gate, up, silu(gate) and their
product. The rotary cos and sin tables (one per model) are charged to the first layer.

Biases are a GEMM's second parameter: held, synchronised and sharded like its weight, never
cast (autocast keeps no bf16 copy of a bias for backward; the cost model casts params[0] only).
"""

from __future__ import annotations

from parashift.models.llama.spec import LlamaSpec
from parashift.planner.builders import FP32, INT64, SEQUENCE, GraphBuilder, keep, residual_add
from parashift.planner.graph import Graph


def _rms_norm(g: GraphBuilder, name: str, src: str, b: int, s: int, d: int, block: str | None, **tp: object) -> str:
    bsd = ("b", "s", "d")
    return g.add(name, {"b": b, "s": s, "d": d}, bsd, srcs=(src,), inputs=(bsd,), kind="norm", nosplit=("d",),
                 params=(("d",),), flops=4.0 * b * s * d, block=block,
                 fp32_inside=True,
                 saved=keep((bsd, FP32), (bsd, FP32), (("b", "s"), FP32)), **tp)


def build(spec: LlamaSpec, batch: int, precision: str) -> Graph:
    """A Llama decoder for one global batch of `batch` sequences at the trainer's `precision`."""
    if precision not in ("bf16", "fp32"):
        raise ValueError(f"precision {precision!r}: expected 'bf16' or 'fp32'")
    b, s, d, v = batch, spec.seq_len, spec.d_model, spec.vocab_size
    h, e, f = spec.kv_heads, spec.hd, spec.hidden
    r = spec.n_heads // h  # query heads per kv head
    low = 2 if precision == "bf16" else 4
    casts = 3 if low < FP32 else 1  # under autocast q, k and v each cast the norm's output
    bsd = ("b", "s", "d")
    g = GraphBuilder(f"llama-{spec.n_layers}x{d}")
    # A head tied to the embedding: one weight, counted (and cast under autocast) at the head,
    # and split over tp with it or not at all.
    tied = {"tp_group": "head"} if spec.tie_embeddings else {}
    x = g.add("embed", {"b": b, "s": s, "v": v, "d": d}, bsd, inputs=(("b", "s"),), kind="embedding",
              reduce=("v",), params=() if spec.tie_embeddings else (("v", "d"),), flops=2.0 * b * s * d, tp_dim="v",
              tp_dims=("v",), part="embed", saved=keep((("b", "s"), INT64)), **tied)
    for i in range(spec.n_layers):
        blk, p = f"layer{i}", f"l{i}."
        attention = {"tp_dims": ("h",), "tp_group": p + "attention", "part": "attention", "layer": i}
        mlp = {"tp_dims": ("f",), "tp_group": p + "mlp", "part": "mlp", "layer": i}
        sequence = {**SEQUENCE, "layer": i}
        n1 = _rms_norm(g, p + "rms1", x, b, s, d, blk, **sequence)
        # Per kv group: its r query heads, its key and its value, packed.
        qkv = g.add(p + "qkv", {"b": b, "s": s, "d": d, "h": h, "q": (r + 2) * e}, ("b", "s", "h", "q"), srcs=(n1,),
                    inputs=(bsd,), kind="matmul", reduce=("d",),
                    params=(("d", "h", "q"), ("h", "q")) if spec.attention_bias else (("d", "h", "q"),),
                    flops=2.0 * b * s * d * h * (r + 2) * e, block=blk, tp_dim="h", saved=keep(*[(bsd, low)] * casts),
                    **attention)
        # Rotary embedding and SDPA (grouped): rotated q and k, v, the output, lse per query head.
        rope = [(("s", "e"), low), (("s", "e"), low)] if i == 0 else []  # cos and sin, shared by every layer
        att = g.add(p + "attn", {"b": b, "s": s, "h": h, "q": (r + 2) * e, "o": r * e, "r": r, "e": e},
                    ("b", "s", "h", "o"), srcs=(qkv,), inputs=(("b", "s", "h", "q"),), kind="attention",
                    nosplit=("s", "q", "o", "r", "e"), flops=4.0 * b * h * r * s * s * e, block=blk, tp_dim="h",
                    saved=keep((("b", "s", "h", "q"), low), (("b", "s", "h", "o"), low), (("b", "s", "h", "r"), FP32),
                               *rope), **attention)
        proj = g.add(p + "proj", {"b": b, "s": s, "h": h, "o": r * e, "d": d}, bsd, srcs=(att,),
                     inputs=(("b", "s", "h", "o"),), kind="matmul", reduce=("h", "o"),
                     params=(("h", "o", "d"), ("d",)) if spec.output_bias else (("h", "o", "d"),),
                     flops=2.0 * b * s * r * h * e * d, block=blk, tp_dim="h", saved=(), **attention)
        add1 = residual_add(g, p + "add1", x, proj, b, s, d, blk, **sequence)
        n2 = _rms_norm(g, p + "rms2", add1, b, s, d, blk, **sequence)
        # gate and up ("g" = 2 of them), silu(gate) * up fused into the op's output.
        fc1 = g.add(p + "fc1", {"b": b, "s": s, "d": d, "g": 2, "f": f}, ("b", "s", "f"), srcs=(n2,), inputs=(bsd,),
                    kind="matmul", reduce=("d", "g"), nosplit=("g",),
                    params=(("d", "g", "f"), ("g", "f")) if spec.mlp_bias else (("d", "g", "f"),),
                    flops=2.0 * b * s * d * 2 * f, block=blk, tp_dim="f", gemm_output=("b", "s", "g", "f"),
                    saved=keep(*[(bsd, low)] * (2 if low < FP32 else 1), (("b", "s", "g", "f"), low),
                               (("b", "s", "f"), low)), **mlp)
        fc2 = g.add(p + "fc2", {"b": b, "s": s, "f": f, "d": d}, bsd, srcs=(fc1,), inputs=(("b", "s", "f"),),
                    kind="matmul", reduce=("f",), params=(("f", "d"), ("d",)) if spec.mlp_bias else (("f", "d"),),
                    flops=2.0 * b * s * d * f, block=blk, tp_dim="f", saved=keep((("b", "s", "f"), low)), **mlp)
        x = residual_add(g, p + "add2", add1, fc2, b, s, d, blk, **sequence)
    norm = _rms_norm(g, "rms_f", x, b, s, d, None, **SEQUENCE)
    # The norm's output (fp32), or its bf16 copy under autocast.
    head = g.add("head", {"b": b, "s": s, "d": d, "v": v}, ("b", "s", "v"), srcs=(norm,), inputs=(bsd,),
                 kind="matmul", reduce=("d",), params=(("d", "v"),), flops=2.0 * b * s * d * v, tp_dim="v",
                 tp_dims=("v",), tp_group="head", part="head", saved=keep((bsd, low)))
    g.add("loss", {"b": b, "s": s, "v": v}, ("b", "s"), srcs=(head,), inputs=(("b", "s", "v"),), kind="loss",
          reduce=("v",), flops=5.0 * b * s * v, tp_dim="v", tp_dims=("v",), tp_needs="head", part="loss",
          saved=keep((("b", "s", "v"), FP32), (("b", "s"), INT64)),
          transient=keep((("b", "s", "v"), FP32), (("b", "s", "v"), FP32)))  # the two fp32 logit gradients
    return g.build(act_bytes=low, weight_cast_bytes=2 if low < FP32 else 0)
