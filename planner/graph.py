"""The op graph the planner searches over, and its JSON format.

Why an explicit, hand-described graph rather than a raw torch.fx trace: PaSE's search needs each
op's *iteration space* (named dims, which ones are summed over) and how each tensor's axes map
onto those dims. An aten/fx trace gives shapes but not that correspondence (a `mm` after a
`view` has lost the head dim), so the builders below describe models at module/einsum level,
and graphs from elsewhere arrive through the JSON format.

JSON format (what `parashift plan --graph FILE.json` reads; `graph_to_json` writes it)::

    {
      "name": "my-model",
      "batch_dim": "b",            # the dim data parallelism splits
      "act_bytes": 2,              # bytes per activation element (bf16)
      "grad_bytes": 4,             # bytes per gradient element in the gradient all-reduce
      "param_state_bytes": 16,     # bytes per parameter held: weights + grads + Adam moments
      "weight_cast_bytes": 0,      # bytes per element of the low-precision weight copy a GEMM
                                   # keeps for backward under autocast (0: weights used as held)
      "ops": [
        {"name": "fc1", "kind": "matmul",
         "dims": {"b": 8, "s": 128, "d": 512, "f": 2048},   # iteration space, in order
         "reduce": ["d"],                                     # summed dims (not in the output)
         "nosplit": [],                                       # dims that must not be split
         "inputs": [["b", "s", "d"]],                         # activation inputs, axes as dims
         "output": ["b", "s", "f"],
         "params": [["d", "f"]],                              # weight tensors, axes as dims (a GEMM's
                                                              # first is its weight operand; more: biases)
         "flops": 2.0e9,                                      # forward FLOPs of the whole op
         "block": "layer0",                                   # optional: repeated-block instance
         "part": "mlp", "layer": 0,                           # optional: what the trainer runs it as
         "tp_dim": "f",                                       # optional: dim Megatron splits
         "tp_dims": ["f"],                                    # optional: dims "tp" may split
         "tp_group": "layer0.mlp",                            # optional: tie group on "tp"
         "tp_needs": null,                                    # optional: group it depends on
         "tp_required": false,                                # optional: must split over "tp"
         "saved": [{"dims": ["b", "s", "d"], "bytes": 2}]}    # optional: what backward keeps
      ],
      "edges": [{"src": "ln2", "dst": "fc1", "slot": 0}]    # src's output is dst's input[slot]
    }

An edge maps the producer's output axes positionally onto the consumer's input axes; their
sizes must agree. Ops with an input slot and no edge read graph inputs (token ids, images).

What the "tp" mesh axis may do (for a trainer that implements only some layouts; all optional,
and a graph without them is searched over every layout, as PaSE does):

- `tp_dims`: the dims "tp" may split (one of them, or none: replicated over tp). null: any dim;
  []: none. "dp" splits only `batch_dim` whatever this says (planner/configs.py).
- `tp_group`: a tie group. In a plan either every op of the group splits one of its `tp_dims`
  over "tp", or none does (the group is *on* or *off*).
- `tp_needs`: a group name; the op may split over "tp" only if that group is on (a vocab-parallel
  loss needs a vocab-parallel head). A group with no op in the graph constrains nothing.
- `tp_required`: the op must split one of its `tp_dims` over "tp" when the mesh has a "tp" axis
  (the search sets it to fix a group on, planner/stage.py `TieVariants`; where a graph sets it
  itself, a mesh whose "tp" axis divides none of the dims the op may split leaves it no
  configuration, and the search leaves that mesh out, planner/outer.py).

These apply to named meshes (planner/configs.py `named_mesh`); PaSE's counts space ignores them.

`saved`: the activations the op's backward pass keeps, each a tensor of the op's dims at its own
element size (autocast keeps some in fp32, token ids are int64). Without it an op is taken to
keep its output at `act_bytes`, which counts every intermediate tensor once; the GPT builder
declares what the trainer's autograd really keeps (tests/test_activation_memory.py measures it).

`part` and `layer` say which part of the trainer's GPT an op is ("embed", "sequence",
"attention", "mlp", "head", "loss"); a plan is executable by the trainer only for a graph whose
every op says so (planner/execution.py turns per-op splits into the trainer's terms).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from math import prod
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, model_validator

Dims = tuple[str, ...]
MAX_DIM = 2**40  # a dim larger than this is a typo, and its products overflow the cost tables


class Saved(BaseModel):
    """One tensor an op keeps for its backward pass: its dims (the op's) and element size."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dims: Dims
    bytes: PositiveInt


class Op(BaseModel):
    """One vertex: an iteration space, the tensors it reads and writes as tuples of its dims."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    name: str = Field(min_length=1)
    kind: str = "op"
    dims: dict[str, Annotated[int, Field(gt=0, le=MAX_DIM)]]
    reduce: tuple[str, ...] = ()
    nosplit: tuple[str, ...] = ()
    inputs: tuple[Dims, ...] = ()
    output: Dims
    params: tuple[Dims, ...] = ()
    flops: float = Field(0.0, ge=0.0)
    block: str | None = None
    # The part of the model the trainer executes this op in (planner.execution): "embed",
    # "sequence" (norms, residual adds), "attention", "mlp", "head", "loss"; and its layer.
    part: str | None = None
    layer: int | None = Field(default=None, ge=0)
    tp_dim: str | None = None
    tp_dims: tuple[str, ...] | None = None
    tp_group: str | None = None
    tp_needs: str | None = None
    tp_required: bool = False
    saved: tuple[Saved, ...] | None = Field(
        default=None, description="activations backward keeps (None: the output at the graph's act_bytes)")
    # Activation checkpointing (planner/checkpointing.py sets these on a checkpointed layer's ops).
    fp32_inside: bool = Field(
        default=False, description="computes in fp32 whatever its input (an upcasting norm): what it keeps stays "
                                   "fp32 under bf16 parameters (planner/checkpointing.py `with_precision`)")
    transient: tuple[Saved, ...] = Field(
        default=(), description="what its backward allocates beside what is kept, at the step's peak (the "
                                "loss's gradients of the logits), once per step")
    gemm_output: Dims | None = Field(
        default=None, description="the GEMM's own result where the op's output is computed from it (gate and up "
                                  "before SwiGLU's product): what selective checkpointing keeps; None: the output")
    gathered_input: bool = Field(
        default=False, description="selective checkpointing keeps its input as gathered over tp (the sequence-parallel "
                                   "all-gather's output, a collective's) where it splits over tp")
    checkpointed: bool = Field(default=False, description="in a checkpointed layer (its weight casts are redone)")
    recompute: bool = Field(default=False, description="its forward runs again in backward")
    recomputed: tuple[Saved, ...] = Field(
        default=(), description="what its recomputation holds while its layer's backward runs (one layer at a time)")

    def _tensors(self) -> Iterator[tuple[str, Dims]]:
        """Each tensor of the op with the name the JSON format gives it (`inputs[0]`, `output`...)."""
        yield from ((f"inputs[{i}]", t) for i, t in enumerate(self.inputs))
        yield "output", self.output
        yield from ((f"params[{i}]", t) for i, t in enumerate(self.params))
        yield from ((f"saved[{i}]", s.dims) for i, s in enumerate(self.saved or ()))

    @model_validator(mode="after")
    def _tensors_name_each_dim_once(self) -> Op:
        """A tensor axis is one dim: `["d", "d"]` has no layout a split could give (which axis
        would a split of d shard?), and its element count would be d squared."""
        for where, tensor in self._tensors():
            twice = next((d for i, d in enumerate(tensor) if d in tensor[:i]), None)
            if twice is not None:
                raise ValueError(f"op {self.name}: tensor {where} {list(tensor)} names dim {twice!r} twice")
        return self

    @model_validator(mode="after")
    def _tensors_use_own_dims(self) -> Op:
        known = set(self.dims)
        kept = (tuple(s.dims for s in (*(self.saved or ()), *self.transient))
                + ((self.gemm_output,) if self.gemm_output else ()))
        for tensor in (*self.inputs, self.output, *self.params, self.reduce, self.nosplit, *kept):
            unknown = set(tensor) - known
            if unknown:
                raise ValueError(f"op {self.name}: dims {sorted(unknown)} not in its iteration space {list(self.dims)}")
        if set(self.reduce) & set(self.output):
            raise ValueError(f"op {self.name}: a reduced dim cannot appear in the output")
        if self.tp_dim is not None and self.tp_dim not in known:
            raise ValueError(f"op {self.name}: tp_dim {self.tp_dim!r} is not one of its dims")
        if self.tp_dims is not None and set(self.tp_dims) - known:
            raise ValueError(f"op {self.name}: tp_dims {sorted(set(self.tp_dims) - known)} not in its iteration space")
        if self.tp_required and self.tp_dims == ():
            raise ValueError(f"op {self.name}: tp_required with no tp_dims to split")
        return self

    def numel(self, dims: Iterable[str]) -> int:
        """Elements of a tensor indexed by `dims` of this op."""
        return prod(self.dims[d] for d in dims)

    @property
    def param_count(self) -> int:
        return sum(self.numel(p) for p in self.params)

    def signature(self) -> str:
        """Everything the cost model reads, without the name: equal signatures cost the same.

        Tie groups (`tp_group`, `tp_needs`) and the layer are left out: they constrain
        combinations of ops, not one op's costs, and differ per layer (planner/problem.py
        `tie_factors`)."""
        body = self.model_dump(exclude={"name", "block", "layer", "tp_group", "tp_needs"})
        return hashlib.sha1(json.dumps(body, sort_keys=True).encode()).hexdigest()


class Edge(BaseModel):
    """`src`'s output feeds input `slot` of `dst`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    src: str
    dst: str
    slot: int = Field(0, ge=0)


class Graph(BaseModel):
    """A DAG of ops in topological order, with the byte sizes the memory model needs."""

    model_config = ConfigDict(extra="forbid")

    name: str = "graph"
    batch_dim: str = "b"
    act_bytes: PositiveInt = 2
    grad_bytes: PositiveInt = 4
    # Mixed-precision Adam holds 16 bytes per parameter: fp16 weight and grad, fp32 master
    # weight and two moments (ZeRO, Rajbhandari et al. 2020, section 3.1).
    param_state_bytes: PositiveInt = 16
    # Autocast runs GEMMs on a low-precision copy of each weight and keeps that copy for the
    # backward pass: held once per step (it is cached across the micro-batches of one autocast
    # region), 2 bytes per weight element under bf16 autocast over fp32 weights.
    weight_cast_bytes: int = Field(0, ge=0)
    # Bytes per element of a weight FSDP gathers: the parameters as held (fp32 under autocast),
    # or FSDP2's bf16 parameter dtype (mixed precision). None: act_bytes.
    gather_bytes: int | None = Field(None, ge=1)
    # Checkpointed layers: one layer's recomputation is live at a time, so each op's `recomputed`
    # counts 1/recompute_layers of itself (the sum is one layer's, exact for identical layers).
    recompute_layers: int = Field(1, ge=1)
    # Bytes per element of the residual stream between layers (what a checkpointed layer keeps
    # of its input); None: as its first op keeps its input (fp32 under autocast).
    stream_bytes: int | None = Field(None, ge=1)
    # The part of that one layer's recomputation counted on top of the ops' own transients (the
    # loss's logit gradients, freed before any layer is recomputed): the backward's peak is the
    # larger of the two, not their sum (planner/checkpointing.py).
    recompute_share: float = Field(1.0, ge=0.0, le=1.0)
    ops: list[Op] = Field(default_factory=list)
    edges: list[Edge] = Field(default_factory=list)

    @model_validator(mode="after")
    def _edges_fit(self) -> Graph:
        index = {op.name: i for i, op in enumerate(self.ops)}
        if len(index) != len(self.ops):
            names = [op.name for op in self.ops]
            twice = next(name for i, name in enumerate(names) if name in names[:i])
            raise ValueError(f"op names must be unique: {twice!r} appears more than once")
        fed: set[tuple[str, int]] = set()
        for edge in self.edges:
            for end in (edge.src, edge.dst):
                if end not in index:
                    raise ValueError(f"edge {edge.src}->{edge.dst}: no op is named {end!r}")
            if edge.src == edge.dst:
                raise ValueError(f"edge {edge.src}->{edge.dst}: an op cannot feed itself")
            if (edge.dst, edge.slot) in fed:
                raise ValueError(f"edge {edge.src}->{edge.dst}: input slot {edge.slot} of {edge.dst} already has an edge")
            fed.add((edge.dst, edge.slot))
            if index[edge.src] >= index[edge.dst]:
                raise ValueError(f"edge {edge.src}->{edge.dst}: ops must be listed in topological order "
                                 f"({edge.dst} comes before {edge.src}; a cycle has no such order)")
            src, dst = self.ops[index[edge.src]], self.ops[index[edge.dst]]
            if edge.slot >= len(dst.inputs):
                raise ValueError(f"edge {edge.src}->{edge.dst}: {dst.name} has no input slot {edge.slot}")
            want = [dst.dims[d] for d in dst.inputs[edge.slot]]
            have = [src.dims[d] for d in src.output]
            if want != have:
                raise ValueError(f"edge {edge.src}->{edge.dst}: output shape {have} != input shape {want}")
        return self

    def op(self, name: str) -> Op:
        return self.ops[self.index()[name]]

    def index(self) -> dict[str, int]:
        return {op.name: i for i, op in enumerate(self.ops)}

    @property
    def n_params(self) -> int:
        return sum(op.param_count for op in self.ops)

    @property
    def flops(self) -> float:
        return sum(op.flops for op in self.ops)

    def with_batch(self, batch: int) -> Graph:
        """The same graph for another batch size (a micro-batch, a data-parallel share)."""
        return self.model_copy(update={"ops": [self.op_with_batch(op, batch) for op in self.ops]})

    def op_with_batch(self, op: Op, batch: int) -> Op:
        """One op as `with_batch(batch)` has it."""
        if self.batch_dim not in op.dims:
            return op
        return op.model_copy(update={"dims": {d: (batch if d == self.batch_dim else n) for d, n in op.dims.items()},
                                     "flops": op.flops * batch / op.dims[self.batch_dim]})

    def tp_groups(self) -> dict[str, list[str]]:
        """Tie group -> the names of its ops, in op order."""
        out: dict[str, list[str]] = {}
        for op in self.ops:
            if op.tp_group is not None:
                out.setdefault(op.tp_group, []).append(op.name)
        return out

    def anchor_blocks(self) -> dict[str, str | None]:
        """Op name -> the block it travels with when blocks are cut into pipeline stages: its
        own, else the last block before it, else the first block (as planner/pipeline.py
        `stage_ops` assigns ops to stages). None only in a graph without blocks."""
        current = next((op.block for op in self.ops if op.block is not None), None)
        out = {}
        for op in self.ops:
            current = op.block if op.block is not None else current
            out[op.name] = current
        return out

    def spanning_tp_groups(self) -> list[str]:
        """Tie groups whose ops, or the ops that need them (`tp_needs`), travel with different
        blocks, so a stage split may separate them; in order of first appearance."""
        anchor = self.anchor_blocks()
        seen: dict[str, set[str | None]] = {}
        for op in self.ops:
            for group in (op.tp_group, op.tp_needs):
                if group is not None:
                    seen.setdefault(group, set()).add(anchor[op.name])
        groups = self.tp_groups()
        return [g for g in groups if len(seen[g]) > 1]

    def with_tp_states(self, states: dict[str, bool]) -> Graph:
        """The graph with the tie groups in `states` fixed on (True) or off (False).

        Off: the group's ops, and the ops that need the group, split nothing over "tp"
        (`tp_dims` = ()). On: the group's ops must split one of their `tp_dims`
        (`tp_required`), and the ops needing it are free. Fixed groups are dissolved
        (`tp_group` / `tp_needs` cleared), so no tie remains to enforce between them.
        """
        if not states:
            return self
        ops = []
        for op in self.ops:
            update: dict[str, object] = {}
            if op.tp_group in states:
                update["tp_group"] = None
                if states[op.tp_group]:
                    update["tp_required"] = True
                else:
                    update["tp_dims"] = ()
            if op.tp_needs in states:
                update["tp_needs"] = None
                if not states[op.tp_needs]:
                    update["tp_dims"] = ()
            ops.append(op.model_copy(update=update) if update else op)
        return self.model_copy(update={"ops": ops})

    def subgraph(self, names: Iterable[str]) -> Graph:
        """The ops named, and the edges between them (inputs from outside become graph inputs).
        A checkpointed graph's one-layer recomputation is the subgraph's own: a pipeline stage
        recomputes one of its layers at a time, so each of its layer ops counts 1/(its layers)."""
        keep = set(names)
        ops = [op for op in self.ops if op.name in keep]
        update: dict[str, object] = {"ops": ops, "edges": [e for e in self.edges if e.src in keep and e.dst in keep]}
        layers = len({op.block for op in ops if op.checkpointed})
        if layers:
            update["recompute_layers"] = layers
            update["recompute_share"] = recompute_share(ops, layers)
        return self.model_copy(update=update)


def recompute_share(ops: list[Op], layers: int) -> float:
    """What part of one layer's recomputation raises the backward's peak above the loss's own
    transients (held first, freed before the last layer is recomputed): the peak is the larger
    of the two. Taken at the graph's own (unsplit) sizes, where both scale alike with the batch."""
    layer = sum(t.bytes * op.numel(t.dims) for op in ops if op.checkpointed for t in op.recomputed) / layers
    other = sum(t.bytes * op.numel(t.dims) for op in ops if not op.checkpointed for t in op.transient)
    return max(0.0, 1.0 - other / layer) if layer > 0 else 1.0


def graph_to_json(graph: Graph) -> str:
    """The documented JSON form (module docstring)."""
    return graph.model_dump_json(indent=1, exclude_defaults=False)


class GraphError(ValueError):
    """A graph file that is not a valid graph: one line per problem, naming the op and field."""

    def __init__(self, path: str | Path, problems: list[str]) -> None:
        self.problems = [f"{path}: {p}" for p in problems]
        super().__init__("; ".join(self.problems))


def load_graph_json(path: str | Path) -> Graph:
    """Read a graph written by `graph_to_json` or by hand in the documented format; GraphError
    says what is wrong (`ops[3].dims.b: ...`, or which op's edge), one line per problem."""
    from pydantic import ValidationError

    try:
        raw = json.loads(Path(path).read_text())
    except OSError as error:
        raise GraphError(path, [f"cannot read it: {error.strerror or error}"]) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise GraphError(path, [f"not JSON: {error}"]) from None
    try:
        graph = Graph.model_validate(raw)
    except ValidationError as error:
        problems = []
        for e in error.errors():
            where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in e["loc"]).lstrip(".")
            names = raw.get("ops") if isinstance(raw, dict) else None
            if e["loc"][:1] == ("ops",) and len(e["loc"]) > 1 and isinstance(names, list):
                i = e["loc"][1]
                if isinstance(i, int) and i < len(names) and isinstance(names[i], dict) and "name" in names[i]:
                    where += f" (op {names[i]['name']!r})"
            message = e["msg"].removeprefix("Value error, ")
            problems.append(f"{where}: {message}" if where else message)
        raise GraphError(path, problems) from None
    # What a model may hold but a file to plan may not: nothing to plan, or nothing for data
    # parallelism to split (it would silently replicate every op).
    if not graph.ops:
        raise GraphError(path, ["ops: a graph to plan needs at least one op"])
    if not any(graph.batch_dim in op.dims for op in graph.ops):
        raise GraphError(path, [f"batch_dim: {graph.batch_dim!r} is not a dim of any op (data parallelism splits it)"])
    return graph


__all__ = ["Edge", "Graph", "GraphError", "Op", "graph_to_json", "load_graph_json"]
