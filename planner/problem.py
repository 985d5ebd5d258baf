"""From a graph and its cost tables to the numeric problem the DP solves, and back.

The objective of one stage is its step time plus lambda x its memory per device: time counts
`weight` evaluations of each op (micro-batches, plus the pipeline bubble) and the weight-gradient
sync once; memory counts parameter state once and `inflight` micro-batches of activations.
Lambda = 0 is the plain time minimum; a positive lambda trades time for memory (search.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planner.costs import CostModel
from planner.dp import Factor, Problem
from planner.graph import Graph


@dataclass(frozen=True)
class Weights:
    """How a stage's per-evaluation costs add up to a step."""

    weight: float = 1.0  # evaluations of each op on the critical path per step
    inflight: float = 1.0  # micro-batches whose activations are held at once


UNPIPELINED = Weights()


def build_problem(graph: Graph, costs: CostModel, lam: float = 0.0, w: Weights = UNPIPELINED) -> Problem:
    """One variable per op (its configuration index); unary and edge tables as factors.

    Tables are shared between ops of equal signature (same arrays), which is what lets the DP
    recognise identical blocks.
    """
    index = graph.index()
    unary: dict[int, np.ndarray] = {}
    scaled: dict[int, np.ndarray] = {}
    factors: list[Factor] = []
    card: list[int] = []
    for v, op in enumerate(graph.ops):
        c = costs.op_cost(op)
        if id(c) not in unary:
            unary[id(c)] = w.weight * (c.compute + c.comm) + c.grad_comm + lam * (c.param_mem + w.inflight * c.act_mem)
        factors.append(Factor((v,), unary[id(c)], owner=op.block))
        card.append(len(c.configs))
    for e in graph.edges:
        table = costs.edge_cost(e)
        if w.weight != 1.0:
            if id(table) not in scaled:
                scaled[id(table)] = w.weight * table
            table = scaled[id(table)]
        s, d = index[e.src], index[e.dst]
        factors.append(Factor((s, d), table, owner=graph.ops[d].block))
    block_of = {v: op.block for v, op in enumerate(graph.ops) if op.block is not None}
    return Problem(card=card, factors=factors, block_of=block_of)


@dataclass
class OpBreakdown:
    compute_s: float
    comm_s: float  # collectives inside the op + layout conversion of its inputs + gradient sync
    memory_bytes: float


def breakdown(graph: Graph, costs: CostModel, assign: list[int], w: Weights = UNPIPELINED) -> list[OpBreakdown]:
    """Per-op time and memory of an assignment; layout conversions are charged to the consumer."""
    index = graph.index()
    rows = []
    for v, op in enumerate(graph.ops):
        c = costs.op_cost(op)
        i = assign[v]
        rows.append(OpBreakdown(w.weight * float(c.compute[i]), w.weight * float(c.comm[i]) + float(c.grad_comm[i]),
                                float(c.param_mem[i] + w.inflight * c.act_mem[i])))
    for e in graph.edges:
        s, d = index[e.src], index[e.dst]
        rows[d].comm_s += w.weight * float(costs.edge_cost(e)[assign[s], assign[d]])
    return rows
