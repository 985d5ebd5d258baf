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
      "ops": [
        {"name": "fc1", "kind": "matmul",
         "dims": {"b": 8, "s": 128, "d": 512, "f": 2048},   # iteration space, in order
         "reduce": ["d"],                                     # summed dims (not in the output)
         "nosplit": [],                                       # dims that must not be split
         "inputs": [["b", "s", "d"]],                         # activation inputs, axes as dims
         "output": ["b", "s", "f"],
         "params": [["d", "f"]],                              # weight tensors, axes as dims
         "flops": 2.0e9,                                      # forward FLOPs of the whole op
         "block": "layer0",                                   # optional: repeated-block instance
         "tp_dim": "f"}                                       # optional: dim Megatron splits
      ],
      "edges": [{"src": "ln2", "dst": "fc1", "slot": 0}]    # src's output is dst's input[slot]
    }

An edge maps the producer's output axes positionally onto the consumer's input axes; their
sizes must agree. Ops with an input slot and no edge read graph inputs (token ids, images).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from math import prod
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

Dims = tuple[str, ...]


class Op(BaseModel):
    """One vertex: an iteration space, the tensors it reads and writes as tuples of its dims."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    kind: str = "op"
    dims: dict[str, int]
    reduce: tuple[str, ...] = ()
    nosplit: tuple[str, ...] = ()
    inputs: tuple[Dims, ...] = ()
    output: Dims
    params: tuple[Dims, ...] = ()
    flops: float = 0.0
    block: str | None = None
    tp_dim: str | None = None

    @model_validator(mode="after")
    def _tensors_use_own_dims(self) -> Op:
        known = set(self.dims)
        for tensor in (*self.inputs, self.output, *self.params, self.reduce, self.nosplit):
            unknown = set(tensor) - known
            if unknown:
                raise ValueError(f"op {self.name}: dims {sorted(unknown)} not in its iteration space {list(self.dims)}")
        if set(self.reduce) & set(self.output):
            raise ValueError(f"op {self.name}: a reduced dim cannot appear in the output")
        if self.tp_dim is not None and self.tp_dim not in known:
            raise ValueError(f"op {self.name}: tp_dim {self.tp_dim!r} is not one of its dims")
        return self

    def numel(self, dims: Iterable[str]) -> int:
        """Elements of a tensor indexed by `dims` of this op."""
        return prod(self.dims[d] for d in dims)

    @property
    def param_count(self) -> int:
        return sum(self.numel(p) for p in self.params)

    def signature(self) -> str:
        """Everything the cost model reads, without the name: equal signatures cost the same."""
        body = self.model_dump(exclude={"name", "block"})
        return hashlib.sha1(json.dumps(body, sort_keys=True).encode()).hexdigest()


class Edge(BaseModel):
    """`src`'s output feeds input `slot` of `dst`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    src: str
    dst: str
    slot: int = 0


class Graph(BaseModel):
    """A DAG of ops in topological order, with the byte sizes the memory model needs."""

    model_config = ConfigDict(extra="forbid")

    name: str = "graph"
    batch_dim: str = "b"
    act_bytes: int = 2
    grad_bytes: int = 4
    # Mixed-precision Adam holds 16 bytes per parameter: fp16 weight and grad, fp32 master
    # weight and two moments (ZeRO, Rajbhandari et al. 2020, section 3.1).
    param_state_bytes: int = 16
    ops: list[Op] = Field(default_factory=list)
    edges: list[Edge] = Field(default_factory=list)

    @model_validator(mode="after")
    def _edges_fit(self) -> Graph:
        index = {op.name: i for i, op in enumerate(self.ops)}
        if len(index) != len(self.ops):
            raise ValueError("op names must be unique")
        for edge in self.edges:
            if edge.src not in index or edge.dst not in index:
                raise ValueError(f"edge {edge.src}->{edge.dst}: unknown op")
            if index[edge.src] >= index[edge.dst]:
                raise ValueError(f"edge {edge.src}->{edge.dst}: ops must be listed in topological order")
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

    def subgraph(self, names: Iterable[str]) -> Graph:
        """The ops named, and the edges between them (inputs from outside become graph inputs)."""
        keep = set(names)
        return self.model_copy(update={
            "ops": [op for op in self.ops if op.name in keep],
            "edges": [e for e in self.edges if e.src in keep and e.dst in keep],
        })


def graph_to_json(graph: Graph) -> str:
    """The documented JSON form (module docstring)."""
    return graph.model_dump_json(indent=1, exclude_defaults=False)


def load_graph_json(path: str | Path) -> Graph:
    """Read a graph written by `graph_to_json` or by hand in the documented format."""
    return Graph.model_validate_json(Path(path).read_text())


# Builders live in their own module; re-exported here because callers look for them here.
from planner.builders import (  # noqa: E402
    gpt3_175b_graph,
    gpt_graph,
    inception_graph,
    pase_transformer_graph,
)

__all__ = [
    "Edge",
    "Graph",
    "Op",
    "gpt3_175b_graph",
    "gpt_graph",
    "graph_to_json",
    "inception_graph",
    "load_graph_json",
    "pase_transformer_graph",
]
