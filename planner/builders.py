"""Graph builders for the models the planner is benchmarked on.

Each builder describes a model at the granularity its placements are executed at: GPT at module
level (the trainer applies Colwise/Rowwise styles per linear), PaSE's Transformer at einsum level
(as in PaSE's evaluation, heads a splittable dim), an Inception-style CNN as a branching DAG.
Ops of one transformer layer carry the same `block` tag so the search can memoise identical
blocks and stay linear in depth.
"""

from __future__ import annotations

from parashift.planner.graph import Dims, Edge, Graph, Op, Saved


class GraphBuilder:
    """Appends ops in topological order; `srcs` names the producer of each input slot."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.ops: list[Op] = []
        self.edges: list[Edge] = []

    def add(self, name: str, dims: dict[str, int], output: Dims, *, srcs: tuple[str | None, ...] = (),
            inputs: tuple[Dims, ...] = (), **fields: object) -> str:
        """Add an op; `srcs[i]` (None: a graph input) feeds `inputs[i]`. Returns the op name."""
        self.ops.append(Op(name=name, dims=dims, output=output, inputs=inputs, **fields))
        for slot, src in enumerate(srcs):
            if src is not None:
                self.edges.append(Edge(src=src, dst=name, slot=slot))
        return name

    def build(self, **fields: object) -> Graph:
        return Graph(name=self.name, ops=self.ops, edges=self.edges, **fields)


def keep(*tensors: tuple[Dims, int]) -> tuple[Saved, ...]:
    """What an op's backward keeps: (dims, bytes per element) each."""
    return tuple(Saved(dims=dims, bytes=size) for dims, size in tensors)


# Autocast runs norms, the residual stream and the loss's log-softmax in fp32 whatever the
# compute precision; token ids are int64.
FP32, INT64 = 4, 8


def _layer_norm(g: GraphBuilder, name: str, src: str, b: int, s: int, d: int, block: str | None,
                **tp: object) -> str:
    # Statistics run over d: splitting d needs an extra all-reduce the trainer's styles do not
    # implement (Megatron splits s instead: sequence parallel), so d is `nosplit`. Backward
    # keeps the (fp32) input and the mean and reciprocal deviation per token.
    return g.add(name, {"b": b, "s": s, "d": d}, ("b", "s", "d"), srcs=(src,), inputs=(("b", "s", "d"),),
                 kind="norm", nosplit=("d",), params=(("d",), ("d",)), flops=8.0 * b * s * d, block=block,
                 saved=keep((("b", "s", "d"), FP32), (("b", "s"), 2 * FP32)), **tp)


def residual_add(g: GraphBuilder, name: str, x: str, y: str, b: int, s: int, d: int, block: str | None,
                 **fields: object) -> str:
    bsd = ("b", "s", "d")
    return g.add(name, {"b": b, "s": s, "d": d}, bsd, srcs=(x, y), inputs=(bsd, bsd), kind="elementwise",
                 flops=1.0 * b * s * d, block=block, saved=(), **fields)


# What the trainer executes over "tp" (planner/execution.py turns a plan's choice into the
# trainer's terms through each op's `part` and `layer`), as gpt_graph declares it: norms and residual adds split s (sequence parallel), all of them or none; per layer,
# attention (qkv, attn, proj) splits heads and the MLP (fc1, fc2) the hidden dim, each region
# all or none; the embedding, head and loss split the vocabulary, the loss only if the head does.
SEQUENCE = {"tp_dims": ("s",), "tp_group": "sequence", "part": "sequence"}


def gpt_graph(n_layers: int, d_model: int, n_heads: int, vocab_size: int, seq_len: int, batch: int,
              ff_mult: int = 4, precision: str = "bf16") -> Graph:
    """A GPT-2/3 style decoder at module level: 10 ops per layer, plus embedding, head and loss.

    Ops declare the layouts the trainer executes over "tp" (`SEQUENCE` above; planner/graph.py
    `tp_dims`, `tp_group`, `tp_needs`), so the planner searches only those: the batch is never
    split over "tp" (that plan is the dp x tp data-parallel mesh, searched as such).

    `precision` is the trainer's: "bf16" (autocast over fp32 weights) or "fp32". Each op's
    `saved` is what autograd keeps for the trainer's modules (models/gpt/model.py) under it, as
    measured by tests/test_activation_memory.py: 40 bytes per token and d_model per layer in
    bf16 (plus per-row statistics), of which 8 are the fp32 norm inputs and 6 the q, k and v
    projections' own bf16 copies of their input; Megatron's 34 s·b·h (Korthikanti et al. 2022)
    counts 2-byte norm inputs, one copy, and two dropout masks the trainer does not keep.
    """
    b, s, d, v, h = batch, seq_len, d_model, vocab_size, n_heads
    if d % h:
        raise ValueError(f"n_heads {h} must divide d_model {d}")
    if precision not in ("bf16", "fp32"):
        raise ValueError(f"precision {precision!r}: expected 'bf16' or 'fp32'")
    e, f = d // h, ff_mult * d
    low = 2 if precision == "bf16" else 4
    bsd = ("b", "s", "d")
    g = GraphBuilder(f"gpt-{n_layers}x{d}")
    # Token ids select rows of the (v, d) table: vocab parallel splits v (Partial, then all-reduce).
    x = g.add("embed", {"b": b, "s": s, "v": v, "d": d}, bsd, inputs=(("b", "s"),), kind="embedding",
              reduce=("v",), params=(("v", "d"),), flops=2.0 * b * s * d, tp_dim="v", tp_dims=("v",), part="embed",
              saved=keep((("b", "s"), INT64), (("s",), INT64)))  # token and position ids
    for i in range(n_layers):
        blk = f"layer{i}"
        p = f"l{i}."
        attention = {"tp_dims": ("h",), "tp_group": p + "attention", "part": "attention", "layer": i}
        mlp = {"tp_dims": ("f",), "tp_group": p + "mlp", "part": "mlp", "layer": i}
        sequence = {**SEQUENCE, "layer": i}
        ln1 = _layer_norm(g, p + "ln1", x, b, s, d, blk, **sequence)
        # q, k and v are three linears: under autocast each casts the (fp32) norm output itself.
        qkv = g.add(p + "qkv", {"b": b, "s": s, "d": d, "h": h, "q": 3 * e}, ("b", "s", "h", "q"), srcs=(ln1,),
                    inputs=(bsd,), kind="matmul", reduce=("d",), params=(("d", "h", "q"),),
                    flops=2.0 * b * s * d * 3 * d, block=blk, tp_dim="h",
                    saved=keep(*[(bsd, low)] * (3 if low < FP32 else 1)), **attention)
        # Fused causal attention (SDPA): heads and batch split freely; s needs context parallelism
        # (not implemented by the trainer) and q/e are the packed q,k,v and head dims.
        att = g.add(p + "attn", {"b": b, "s": s, "h": h, "q": 3 * e, "e": e}, ("b", "s", "h", "e"), srcs=(qkv,),
                    inputs=(("b", "s", "h", "q"),), kind="attention", nosplit=("s", "q", "e"),
                    flops=4.0 * b * h * s * s * e, block=blk, tp_dim="h",
                    saved=keep((("b", "s", "h", "q"), low), (("b", "s", "h", "e"), low), (("b", "s", "h"), FP32)),
                    **attention)  # q, k, v, the output and the log-sum-exp per row
        # Its input is attention's output, already kept (a view, not a copy).
        proj = g.add(p + "proj", {"b": b, "s": s, "h": h, "e": e, "d": d}, bsd, srcs=(att,),
                     inputs=(("b", "s", "h", "e"),), kind="matmul", reduce=("h", "e"), params=(("h", "e", "d"),),
                     flops=2.0 * b * s * d * d, block=blk, tp_dim="h", saved=(), **attention)
        add1 = residual_add(g, p + "add1", x, proj, b, s, d, blk, **sequence)
        ln2 = _layer_norm(g, p + "ln2", add1, b, s, d, blk, **sequence)
        fc1 = g.add(p + "fc1", {"b": b, "s": s, "d": d, "f": f}, ("b", "s", "f"), srcs=(ln2,),
                    inputs=(bsd,), kind="matmul", reduce=("d",), params=(("d", "f"),),
                    flops=2.0 * b * s * d * f, block=blk, tp_dim="f",
                    saved=keep((bsd, low), (("b", "s", "f"), low)), **mlp)  # GELU fused: its input kept
        fc2 = g.add(p + "fc2", {"b": b, "s": s, "f": f, "d": d}, bsd, srcs=(fc1,),
                    inputs=(("b", "s", "f"),), kind="matmul", reduce=("f",), params=(("f", "d"),),
                    flops=2.0 * b * s * d * f, block=blk, tp_dim="f", saved=keep((("b", "s", "f"), low)), **mlp)
        x = residual_add(g, p + "add2", add1, fc2, b, s, d, blk, **sequence)
    lnf = _layer_norm(g, "ln_f", x, b, s, d, None, **SEQUENCE)
    head = g.add("head", {"b": b, "s": s, "d": d, "v": v}, ("b", "s", "v"), srcs=(lnf,), inputs=(bsd,),
                 kind="matmul", reduce=("d",), params=(("d", "v"),), flops=2.0 * b * s * d * v, tp_dim="v",
                 tp_dims=("v",), tp_group="head", part="head", saved=keep((bsd, low)))
    # Cross entropy over v: split v is torch's loss_parallel (an all-reduce of per-token stats).
    # Backward keeps the fp32 log-probabilities and the int64 targets.
    g.add("loss", {"b": b, "s": s, "v": v}, ("b", "s"), srcs=(head,), inputs=(("b", "s", "v"),), kind="loss",
          reduce=("v",), flops=5.0 * b * s * v, tp_dim="v", tp_dims=("v",), tp_needs="head", part="loss",
          saved=keep((("b", "s", "v"), FP32), (("b", "s"), INT64)),
          transient=keep((("b", "s", "v"), FP32), (("b", "s", "v"), FP32)))  # the two fp32 logit gradients
    return g.build(act_bytes=low, weight_cast_bytes=2 if low < FP32 else 0)


def gpt3_175b_graph(batch: int = 1536, seq_len: int = 2048) -> Graph:
    """GPT-3 175B (Brown et al. 2020, table 2.1): 96 layers, d 12288, 96 heads, batch 1536 x 2048.

    The vocabulary is 50257 padded to 51200, as Megatron-LM pads it to a multiple of 128 x tp so
    that vocab-parallel splits divide.
    """
    return gpt_graph(n_layers=96, d_model=12288, n_heads=96, vocab_size=51200, seq_len=seq_len, batch=batch)


def _pase_attention(g: GraphBuilder, p: str, xq: str, xkv: str, b: int, s: int, d: int, h: int,
                    blk: str) -> str:
    """Multi-head attention as einsums: q, k, v, scores, softmax, weighted sum, output (7 ops)."""
    e = d // h
    bsd, bshe = ("b", "s", "d"), ("b", "s", "h", "e")
    proj = {"b": b, "s": s, "d": d, "h": h, "e": e}
    q, k, v = (g.add(p + n, proj, bshe, srcs=(src,), inputs=(bsd,), kind="matmul", reduce=("d",),
                     params=(("d", "h", "e"),), flops=2.0 * b * s * d * d, block=blk, tp_dim="h")
               for n, src in (("q", xq), ("k", xkv), ("v", xkv)))
    bhst = ("b", "h", "s", "t")
    sc = g.add(p + "scores", {"b": b, "h": h, "s": s, "t": s, "e": e}, bhst, srcs=(q, k),
               inputs=(bshe, ("b", "t", "h", "e")), kind="matmul", reduce=("e",), flops=2.0 * b * h * s * s * e,
               block=blk, tp_dim="h")
    sm = g.add(p + "softmax", {"b": b, "h": h, "s": s, "t": s}, bhst, srcs=(sc,), inputs=(bhst,),
               kind="elementwise", nosplit=("t",), flops=5.0 * b * h * s * s, block=blk, tp_dim="h")
    av = g.add(p + "av", {"b": b, "h": h, "s": s, "t": s, "e": e}, bshe, srcs=(sm, v),
               inputs=(bhst, ("b", "t", "h", "e")), kind="matmul", reduce=("t",), flops=2.0 * b * h * s * s * e,
               block=blk, tp_dim="h")
    return g.add(p + "out", {"b": b, "s": s, "h": h, "e": e, "d": d}, bsd, srcs=(av,), inputs=(bshe,),
                 kind="matmul", reduce=("h", "e"), params=(("h", "e", "d"),), flops=2.0 * b * s * d * d,
                 block=blk, tp_dim="h")


def _pase_ffn(g: GraphBuilder, p: str, x: str, b: int, s: int, d: int, f: int, blk: str) -> str:
    h1 = g.add(p + "ff1", {"b": b, "s": s, "d": d, "f": f}, ("b", "s", "f"), srcs=(x,), inputs=(("b", "s", "d"),),
               kind="matmul", reduce=("d",), params=(("d", "f"),), flops=2.0 * b * s * d * f, block=blk, tp_dim="f")
    r = g.add(p + "relu", {"b": b, "s": s, "f": f}, ("b", "s", "f"), srcs=(h1,), inputs=(("b", "s", "f"),),
              kind="elementwise", flops=1.0 * b * s * f, block=blk, tp_dim="f")
    return g.add(p + "ff2", {"b": b, "s": s, "f": f, "d": d}, ("b", "s", "d"), srcs=(r,), inputs=(("b", "s", "f"),),
                 kind="matmul", reduce=("f",), params=(("f", "d"),), flops=2.0 * b * s * d * f, block=blk, tp_dim="f")


def pase_transformer_graph(batch: int = 64, seq_len: int = 256, d_model: int = 512, n_heads: int = 8,
                           ff: int = 2048, layers: int = 6, vocab: int = 50000) -> Graph:
    """PaSE's Transformer workload (Elango 2021, section V): encoder-decoder, einsum-level ops.

    6+6 layers, d 512, 8 heads, ff 2048, vocab 50k, seq 256, batch 64. Every decoder layer's
    cross-attention reads the encoder output, so the graph is far from a chain.
    """
    b, s, d, h, f, v = batch, seq_len, d_model, n_heads, ff, vocab
    g = GraphBuilder("pase-transformer")
    bsd = ("b", "s", "d")
    emb = {"b": b, "s": s, "v": v, "d": d}
    x = g.add("enc_embed", emb, bsd, inputs=(("b", "s"),), kind="embedding", reduce=("v",),
              params=(("v", "d"),), flops=2.0 * b * s * d, tp_dim="v")
    for i in range(layers):
        blk, p = f"enc{i}", f"enc{i}."
        a = _pase_attention(g, p + "att.", x, x, b, s, d, h, blk)
        x = _layer_norm(g, p + "ln1", residual_add(g, p + "add1", x, a, b, s, d, blk), b, s, d, blk)
        y = _pase_ffn(g, p, x, b, s, d, f, blk)
        x = _layer_norm(g, p + "ln2", residual_add(g, p + "add2", x, y, b, s, d, blk), b, s, d, blk)
    memory = x
    x = g.add("dec_embed", emb, bsd, inputs=(("b", "s"),), kind="embedding", reduce=("v",),
              params=(("v", "d"),), flops=2.0 * b * s * d, tp_dim="v")
    for i in range(layers):
        blk, p = f"dec{i}", f"dec{i}."
        a = _pase_attention(g, p + "self.", x, x, b, s, d, h, blk)
        x = _layer_norm(g, p + "ln1", residual_add(g, p + "add1", x, a, b, s, d, blk), b, s, d, blk)
        c = _pase_attention(g, p + "cross.", x, memory, b, s, d, h, blk)
        x = _layer_norm(g, p + "ln2", residual_add(g, p + "add2", x, c, b, s, d, blk), b, s, d, blk)
        y = _pase_ffn(g, p, x, b, s, d, f, blk)
        x = _layer_norm(g, p + "ln3", residual_add(g, p + "add3", x, y, b, s, d, blk), b, s, d, blk)
    logits = g.add("logits", {"b": b, "s": s, "d": d, "v": v}, ("b", "s", "v"), srcs=(x,), inputs=(bsd,),
                   kind="matmul", reduce=("d",), params=(("d", "v"),), flops=2.0 * b * s * d * v, tp_dim="v")
    g.add("loss", {"b": b, "s": s, "v": v}, ("b", "s"), srcs=(logits,), inputs=(("b", "s", "v"),), kind="loss",
          reduce=("v",), flops=5.0 * b * s * v, tp_dim="v")
    return g.build()


def _conv(g: GraphBuilder, name: str, src: str, b: int, c: int, k: int, hw: int, r: int, blk: str | None) -> str:
    """Same-padded r x r convolution as an einsum over (b, k, h, w, c, r, s); halos are ignored."""
    return g.add(name, {"b": b, "k": k, "h": hw, "w": hw, "c": c, "r": r, "s": r}, ("b", "k", "h", "w"),
                 srcs=(src,), inputs=(("b", "c", "h", "w"),), kind="conv", reduce=("c", "r", "s"),
                 nosplit=("r", "s"), params=(("c", "r", "s", "k"),), flops=2.0 * b * k * hw * hw * c * r * r,
                 block=blk, tp_dim="k")


def _pool(g: GraphBuilder, name: str, src: str, b: int, c: int, hw: int, out_hw: int, blk: str | None) -> str:
    """Max pooling; stride 2 when out_hw < hw (then the spatial dims are renamed, not splittable)."""
    if out_hw == hw:
        dims = {"b": b, "c": c, "h": hw, "w": hw}
        return g.add(name, dims, ("b", "c", "h", "w"), srcs=(src,), inputs=(("b", "c", "h", "w"),),
                     kind="pool", flops=9.0 * b * c * hw * hw, block=blk)
    dims = {"b": b, "c": c, "i": hw, "j": hw, "h": out_hw, "w": out_hw}
    return g.add(name, dims, ("b", "c", "h", "w"), srcs=(src,), inputs=(("b", "c", "i", "j"),), kind="pool",
                 nosplit=("i", "j", "h", "w"), flops=9.0 * b * c * out_hw * out_hw, block=blk)


# GoogLeNet's inception modules (Szegedy et al. 2015, table 1): input channels, then
# #1x1, #3x3 reduce, #3x3, #5x5 reduce, #5x5, pool proj; "pool" marks a stride-2 max pool before.
_INCEPTION = [
    ("3a", 192, 64, 96, 128, 16, 32, 32), ("3b", 256, 128, 128, 192, 32, 96, 64), "pool",
    ("4a", 480, 192, 96, 208, 16, 48, 64), ("4b", 512, 160, 112, 224, 24, 64, 64),
    ("4c", 512, 128, 128, 256, 24, 64, 64), ("4d", 512, 112, 144, 288, 32, 64, 64),
    ("4e", 528, 256, 160, 320, 32, 128, 128), "pool",
    ("5a", 832, 256, 160, 320, 32, 128, 128), ("5b", 832, 384, 192, 384, 48, 128, 128),
]


def inception_graph(batch: int = 64) -> Graph:
    """An Inception-v1 (GoogLeNet) style CNN on 224x224 images: four-way branches and concats."""
    b = batch
    g = GraphBuilder("inception")
    x = g.add("stem", {"b": b, "k": 192, "h": 28, "w": 28, "c": 3, "r": 7, "s": 7}, ("b", "k", "h", "w"),
              inputs=(("b", "c", "h", "w"),), kind="conv", reduce=("c", "r", "s"), nosplit=("r", "s"),
              params=(("c", "r", "s", "k"),), flops=2.0 * b * 64 * 112 * 112 * 3 * 49 + 2.0 * b * 192 * 56 * 56 * 64 * 9,
              tp_dim="k")  # conv1 7x7/2 + conv2 3x3, to the 28x28x192 input of inception 3a
    hw, c = 28, 192
    for spec in _INCEPTION:
        if spec == "pool":
            x = _pool(g, f"pool{hw}", x, b, c, hw, hw // 2, None)
            hw //= 2
            continue
        name, c_in, n1, r3, n3, r5, n5, pp = spec
        assert c_in == c, (name, c_in, c)
        blk, p = f"inc{name}", f"inc{name}."
        br1 = _conv(g, p + "1x1", x, b, c, n1, hw, 1, blk)
        br3 = _conv(g, p + "3x3", _conv(g, p + "3x3r", x, b, c, r3, hw, 1, blk), b, r3, n3, hw, 3, blk)
        br5 = _conv(g, p + "5x5", _conv(g, p + "5x5r", x, b, c, r5, hw, 1, blk), b, r5, n5, hw, 5, blk)
        brp = _conv(g, p + "poolproj", _pool(g, p + "pool", x, b, c, hw, hw, blk), b, c, pp, hw, 1, blk)
        c = n1 + n3 + n5 + pp
        dims = {"b": b, "h": hw, "w": hw, "c1": n1, "c3": n3, "c5": n5, "cp": pp, "k": c}
        x = g.add(p + "concat", dims, ("b", "k", "h", "w"), srcs=(br1, br3, br5, brp),
                  inputs=tuple(("b", ci, "h", "w") for ci in ("c1", "c3", "c5", "cp")), kind="concat",
                  nosplit=("c1", "c3", "c5", "cp", "k"), flops=1.0 * b * c * hw * hw, block=blk)
    gap = g.add("avgpool", {"b": b, "k": c, "h": hw, "w": hw}, ("b", "k"), srcs=(x,), inputs=(("b", "k", "h", "w"),),
                kind="pool", reduce=("h", "w"), flops=1.0 * b * c * hw * hw)
    fc = g.add("fc", {"b": b, "k": c, "n": 1000}, ("b", "n"), srcs=(gap,), inputs=(("b", "k"),), kind="matmul",
               reduce=("k",), params=(("k", "n"),), flops=2.0 * b * c * 1000, tp_dim="n")
    g.add("loss", {"b": b, "n": 1000}, ("b",), srcs=(fc,), inputs=(("b", "n"),), kind="loss", reduce=("n",),
          flops=5.0 * b * 1000, tp_dim="n")
    return g.build(act_bytes=2)


def skip_graph(n_ops: int = 50, reach: int = 4, batch: int = 64, seq_len: int = 256, d_model: int = 1024) -> Graph:
    """A skip-heavy stack (a stress test, no blocks): op i is a d x d matmul of the sum of the
    outputs of ops i-1 .. i-`reach` (DenseNet-like connectivity), so every dependent set spans
    `reach` ops and PaSE's per-op DP tables grow as configurations ** reach."""
    b, s, d = batch, seq_len, d_model
    g = GraphBuilder(f"skip{reach}-{n_ops}")
    bsd = ("b", "s", "d")
    names: list[str] = []
    for i in range(n_ops):
        srcs = tuple(names[max(0, i - reach):][::-1]) or (None,)
        names.append(g.add(f"op{i}", {"b": b, "s": s, "d": d, "e": d}, ("b", "s", "e"), srcs=srcs,
                           inputs=tuple(bsd for _ in srcs), kind="matmul", reduce=("d",), params=(("d", "e"),),
                           flops=2.0 * b * s * d * d + (len(srcs) - 1) * b * s * d, tp_dim="e"))
    return g.build()


def chain_graph(n_ops: int = 20_000, batch: int = 64, d_model: int = 256) -> Graph:
    """A long chain of d x d matmuls (a stress test of the elimination order: no blocks)."""
    g = GraphBuilder(f"chain-{n_ops}")
    prev: str | None = None
    for i in range(n_ops):
        a, c = ("m", "n") if i % 2 == 0 else ("n", "m")
        prev = g.add(f"op{i}", {"b": batch, a: d_model, c: d_model}, ("b", c), srcs=(prev,), inputs=(("b", a),),
                     kind="matmul", reduce=(a,), params=((a, c),), flops=2.0 * batch * d_model * d_model, tp_dim=c)
    return g.build()


def dense_dag_graph(n_ops: int = 40, fan_in: int = 8, seed: int = 0) -> Graph:
    """A random dense DAG (a stress test of the search on a user's graph, no blocks): op i reads
    op i-1 and up to `fan_in` - 1 other earlier ops chosen at random, over dims drawn from five,
    a matmul or elementwise op, with parameters on 60% of them. Deterministic in `seed`."""
    import numpy as np

    sizes = {"b": 64, "m": 512, "n": 1024, "k": 256, "j": 2048}
    rng = np.random.default_rng(seed)
    ops: list[Op] = []
    edges: list[Edge] = []
    for i in range(n_ops):
        others = rng.choice(i, size=min(i, fan_in) - 1, replace=False).tolist() if i > 1 else []
        preds = sorted({i - 1, *others}) if i else []
        inputs = [ops[p].output for p in preds] or [("b", "m")]
        dims = sorted({d for t in inputs for d in t} | {str(rng.choice(["m", "n", "k", "j"]))})
        out = tuple(sorted(rng.choice(dims, size=min(2, len(dims)), replace=False).tolist()))
        out = out if "b" in out else ("b", out[0])
        params = (tuple(d for d in dims if d != "b")[:2],) if rng.random() < 0.6 else ()
        ops.append(Op(name=f"op{i}", kind=str(rng.choice(["matmul", "elementwise"])), dims={d: sizes[d] for d in dims},
                      reduce=tuple(d for d in dims if d not in out), inputs=tuple(inputs), output=out, params=params,
                      flops=float(rng.integers(10**8, 10**11)), tp_dim=dims[-1]))
        edges += [Edge(src=f"op{p}", dst=f"op{i}", slot=s) for s, p in enumerate(preds)]
    return Graph(name=f"dense{fan_in}-{n_ops}-{seed}", ops=ops, edges=edges)


def fully_dense_graph(n_ops: int = 40, batch: int = 8, d: int = 64, e: int = 64) -> Graph:
    """The densest DAG: op i is a matmul fed by every earlier op (one input slot each), so
    n(n-1)/2 edges and in- and out-degrees up to n-1: no elimination order keeps dependent sets
    small (a stress test of the bounded search on a user's graph)."""
    g = GraphBuilder(f"fully-dense-{n_ops}")
    for i in range(n_ops):
        srcs = tuple(f"op{j}" for j in range(i))
        g.add(f"op{i}", {"b": batch, "d": d, "e": e}, ("b", "e"), srcs=srcs, inputs=(("b", "d"),) * max(i, 1),
              kind="matmul", reduce=("d",), params=(("d", "e"),), flops=2.0 * batch * d * e * max(i, 1), tp_dim="e")
    return g.build()


def gapped_chain() -> Graph:
    """Six tiny matmuls where, on 8 devices (mesh 2 x 2 x 2: 64,000 assignments), a memory limit
    halfway between the least and the fastest assignment's memory opens a 15% duality gap that
    1,055 assignments fall into: more than the constrained search's budget of DP solves can
    separate (a random property test found it; the tests and bench/constrained_budget.py use it)."""
    def op(i: int, dims: tuple[str, ...], inp: tuple[str, ...], out: tuple[str, ...]) -> Op:
        return Op(name=f"op{i}", kind="matmul", dims=dict.fromkeys(dims, 8), reduce=tuple(d for d in dims if d not in out),
                  inputs=(inp,), output=out, params=(("n",),), flops=1.0, tp_dim="n")
    ops = [op(0, ("b", "n"), ("b", "n"), ("b", "n")), op(1, ("b", "n"), ("b", "n"), ("n",)),
           op(2, ("b", "n"), ("n",), ("n",)), *(op(i, ("n",), ("n",), ("n",)) for i in (3, 4, 5))]
    return Graph(name="random-chain", ops=ops, edges=[Edge(src=f"op{i}", dst=f"op{i + 1}", slot=0) for i in range(5)])
