"""From a graph and its cost tables to the numeric problem the DP solves, and back.

The objective of one stage is its step time plus lambda x its memory per device: time counts
`weight` evaluations of each op (micro-batches, plus the pipeline bubble) and the weight-gradient
sync once; memory counts parameter state once and `inflight` micro-batches of activations.
Lambda = 0 is the plain time minimum; a positive lambda trades time for memory (search.py).

Tie groups (planner/graph.py `Op.tp_group`, `Op.tp_needs`) become pairwise constraint tables
(0 where a pair of configurations is allowed, +inf where not), added to the same problem: the
DP is exact for any tables, so its optimum is the exact optimum over the assignments that keep
every tie. A group's ops are chained by equality tables along the graph's edges between them
(then between op-order neighbours, where edges leave them apart), which keeps the tables local:
a layer's attention group adds nothing the layer's edges do not already connect.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import numpy as np
from parashift.planner.configs import TP, splits_on
from parashift.planner.costs import CostModel, OpCost
from parashift.planner.dp import Factor, Problem
from parashift.planner.graph import Graph


@dataclass(frozen=True)
class Weights:
    """How a stage's per-evaluation costs add up to a step: the one definition of a stage's
    objective terms, which the DP tables, the per-op breakdown, the stage bounds of the outer
    search and the least-memory floor all read (a new cost term is written once, in costs.py).

    Sharded dp (FSDP2, as the trainer runs it: `fully_shard` per block, pipeline stages through
    torch.distributed.pipelining): `gathers` all-gathers of each weight per step and which
    unsharded tensors stay in memory follow the schedule (`schedule`).
    """

    weight: float = 1.0  # evaluations of each op on the critical path per step
    inflight: float = 1.0  # micro-batches whose activations are held at once
    gathers: float = 2.0  # FSDP all-gathers of each weight per step (on the critical path)
    holds_weights: bool = False  # FSDP: the stage's unsharded weights stay gathered
    holds_grads: bool = False  # FSDP: unsharded gradients accumulate over micro-batches
    reshard_after_forward: bool = True  # the plan choice these FSDP terms follow
    pipelined: bool = False  # a pipeline stage: replicated dp's unsharded copies stay for the step

    @classmethod
    def schedule(cls, pp: int, micro_batches: int, reshard_after_forward: bool = True) -> Weights:
        """The weights of a 1F1B pipeline of `pp` stages (or plain accumulation, pp 1) over
        `micro_batches`.

        FSDP2 all-gathers a block's weights before its forward and, after resharding them
        (`reshard_after_forward`), again before its backward. Accumulating over micro-batches
        it keeps unsharded gradients until the last one. A pipeline stage
        (torch.distributed.pipelining) also keeps the weights gathered after each backward
        until the step's end, so in 1F1B a forward finds them gathered: about one gather per
        evaluation, or one per step without resharding after forward.
        """
        m, weight = micro_batches, float(micro_batches + pp - 1)
        if pp > 1:
            gathers, holds_weights, holds_grads = (weight if reshard_after_forward else 1.0), True, True
        else:
            gathers = float(m * (2 if reshard_after_forward else 1))
            holds_weights, holds_grads = not reshard_after_forward, m > 1
        return cls(weight, float(min(m, pp)), gathers, holds_weights, holds_grads, reshard_after_forward, pp > 1)

    def of_stage(self, stage: int, pp: int, micro_batches: int) -> Weights:
        """The same weights for pipeline stage `stage` as 1F1B runs it: it holds min(m, pp - stage)
        micro-batches' activations at once (the first stage the most, the last one). The search
        charges every stage the first's (`schedule`): a bound, where this is each stage's own."""
        return dataclasses.replace(self, inflight=float(min(micro_batches, pp - stage)))

    def compute(self, c: OpCost) -> np.ndarray:
        """Seconds of device work per step, per configuration: each evaluation's forward and
        backward, and once per step the optimizer's update."""
        return self.weight * c.compute + c.update

    def comm(self, c: OpCost) -> np.ndarray:
        """Seconds of communication per step, per configuration: collectives inside each
        evaluation, FSDP's gathers, and once per step the weight-gradient sync."""
        return self.weight * c.comm + self.gathers * c.gather + c.grad_comm

    def time(self, c: OpCost) -> np.ndarray:
        return self.compute(c) + self.comm(c)

    def memory(self, c: OpCost) -> np.ndarray:
        """Bytes per device: parameter state once, activations of the micro-batches in flight,
        autocast's weight copies once, one checkpointed layer's recomputation, and what FSDP
        keeps unsharded."""
        out = c.param_mem + self.inflight * c.act_mem + c.cast_mem + c.recompute_mem
        if self.holds_weights:
            out = out + c.unsharded_weight
        if self.holds_grads:
            out = out + c.unsharded_grad
        if self.pipelined:
            out = out + c.replica_weight
        return out

    def edge(self, table: np.ndarray) -> np.ndarray:
        """Seconds per step of a layout conversion between two ops (each evaluation pays it)."""
        return table if self.weight == 1.0 else self.weight * table


UNPIPELINED = Weights()


# How a tied pair of ops (earlier u, later v) may split over "tp": both or neither, or one only
# if the other does (an op that needs a group, and the group's op it is paired with).
EQUAL, U_NEEDS_V, V_NEEDS_U = "equal", "u-needs-v", "v-needs-u"


def tie_pairs(graph: Graph) -> list[tuple[int, int, str]]:
    """The constrained op pairs (earlier index, later index, relation) that enforce the graph's
    ties (`tie_factors`).

    Each group's ops are joined by a spanning forest of the graph's edges between them, then by
    op-order neighbours from different components; a group with one op gives no pair. An op that
    needs a group is paired with one of its ops it shares an edge with, else the nearest in op
    order; a group absent from the graph constrains nothing.
    """
    ops = tuple((op.name, op.tp_group, op.tp_needs) for op in graph.ops)
    if not any(group is not None for _, group, _ in ops):
        return []
    return list(_tie_pairs(ops, tuple((e.src, e.dst) for e in graph.edges)))


# Why a cache: a search solves the same stage split (the same ops and edges) in many contexts
# (meshes, micro-batch counts), each a graph object of its own, and the pairs depend only on
# this structure (GPT-3 on 16 devices: 687 calls, 1.4 s of a 16 s profile).
@functools.lru_cache(maxsize=256)
def _tie_pairs(ops: tuple[tuple[str, str | None, str | None], ...],
               edges: tuple[tuple[str, str], ...]) -> tuple[tuple[int, int, str], ...]:
    index = {name: i for i, (name, _, _) in enumerate(ops)}
    members: dict[str, list[int]] = {}
    for v, (_, group, _) in enumerate(ops):
        if group is not None:
            members.setdefault(group, []).append(v)
    group_of = {v: g for g, vs in members.items() for v in vs}
    parent = list(range(len(ops)))

    def find(v: int) -> int:
        while parent[v] != v:
            parent[v] = parent[parent[v]]
            v = parent[v]
        return v

    pairs: list[tuple[int, int, str]] = []
    linked: dict[int, set[int]] = {}
    for src, dst in edges:
        s, d = index[src], index[dst]
        linked.setdefault(s, set()).add(d)
        linked.setdefault(d, set()).add(s)
        if s in group_of and group_of.get(d) == group_of[s] and find(s) != find(d):
            parent[find(d)] = find(s)
            pairs.append((s, d, EQUAL))
    for vs in members.values():
        for a, b in zip(vs, vs[1:], strict=False):
            if find(a) != find(b):
                parent[find(b)] = find(a)
                pairs.append((a, b, EQUAL))
    for v, (_, _, needs) in enumerate(ops):
        vs = members.get(needs) if needs is not None else None
        if not vs or v in vs:
            continue
        near = [u for u in vs if u in linked.get(v, ())] or vs
        u = min(near, key=lambda u: (abs(u - v), u))
        pairs.append((v, u, U_NEEDS_V) if v < u else (u, v, V_NEEDS_U))
    return tuple(sorted(pairs))


def tie_factors(graph: Graph, costs: CostModel) -> list[Factor]:
    """Constraint tables (0 allowed, +inf forbidden) for the graph's tie groups on the "tp" axis.

    Empty when the mesh has no "tp" axis (nothing can split over it, every tie holds) or is
    PaSE's counts space. Tables depend only on the two ops' configuration lists, so ops of equal
    signature share them and identical blocks stay identical to the DP.
    """
    mesh = costs.mesh
    if mesh.aligned or TP not in mesh.names:
        return []
    pairs = tie_pairs(graph)
    if not pairs:
        return []
    axis = mesh.names.index(TP)
    on: dict[int, np.ndarray] = {}
    tables: dict[tuple[int, int, str], np.ndarray] = {}

    def split(c: OpCost) -> np.ndarray:
        if id(c) not in on:
            on[id(c)] = np.array([splits_on(cfg, axis) for cfg in c.configs], dtype=bool)
        return on[id(c)]

    out = []
    for u, v, relation in pairs:
        cu, cv = costs.op_cost(graph.ops[u]), costs.op_cost(graph.ops[v])
        key = (id(cu), id(cv), relation)
        if key not in tables:
            a, b = split(cu)[:, None], split(cv)[None, :]
            bad = {EQUAL: a != b, U_NEEDS_V: a & ~b, V_NEEDS_U: b & ~a}[relation]
            tables[key] = np.where(bad, np.inf, 0.0)
        out.append(Factor((u, v), tables[key], owner=graph.ops[v].block))
    return out


@dataclass
class OpBreakdown:
    compute_s: float
    comm_s: float  # collectives inside the op + layout conversion of its inputs + gradient sync
    memory_bytes: float


@dataclass
class ProblemParts:
    """A stage's problem without its multiplier, built once: a constrained search solves the
    same stage at many lambdas and within many domains, and rebuilding the tables (cost lookups,
    edge scaling, tie tables) each time was a fifth of its time. Per distinct op signature:
    its time and memory per configuration, and the lambda-free pairwise tables (edges, ties)."""

    card: list[int]
    block_of: dict[int, str]
    owners: list[str | None]
    signature: list[int]  # per op: its index into the per-signature arrays below
    computes: list[np.ndarray]
    comms: list[np.ndarray]
    times: list[np.ndarray]
    memories: list[np.ndarray]
    edges: list[Factor]  # scaled by the stage's weight
    ties: list[Factor]

    @classmethod
    def of(cls, graph: Graph, costs: CostModel, w: Weights = UNPIPELINED, ties: bool = True) -> ProblemParts:
        """`ties`: False for a breakdown alone, which needs no tie tables."""
        index = graph.index()
        first: dict[int, int] = {}
        signature: list[int] = []
        computes, comms, times, memories = [], [], [], []
        card = []
        for op in graph.ops:
            c = costs.op_cost(op)
            if id(c) not in first:
                first[id(c)] = len(times)
                computes.append(w.compute(c))
                comms.append(w.comm(c))
                times.append(w.time(c))
                memories.append(w.memory(c))
            signature.append(first[id(c)])
            card.append(len(c.configs))
        scaled: dict[int, np.ndarray] = {}
        edges = []
        for e in graph.edges:
            table = costs.edge_cost(e)
            if id(table) not in scaled:
                scaled[id(table)] = w.edge(table)
            edges.append(Factor((index[e.src], index[e.dst]), scaled[id(table)], owner=graph.ops[index[e.dst]].block))
        return cls(card, {v: op.block for v, op in enumerate(graph.ops) if op.block is not None},
                   [op.block for op in graph.ops], signature, computes, comms, times, memories, edges,
                   tie_factors(graph, costs) if ties else [])

    def _problem(self, unary: list[np.ndarray], pairwise: list[Factor]) -> Problem:
        factors = [Factor((v,), unary[k], owner=o) for v, (k, o) in enumerate(zip(self.signature, self.owners, strict=True))]
        return Problem(card=self.card, factors=factors + pairwise, block_of=self.block_of)

    def at(self, lam: float = 0.0) -> Problem:
        """min time + lam x memory: unary, edge and tie tables as factors."""
        return self._problem([t + lam * m for t, m in zip(self.times, self.memories, strict=True)], self.edges + self.ties)

    def memory_only(self) -> Problem:
        """The objective is memory alone (no time, no edges): the least-memory assignment that
        keeps every tie."""
        return self._problem(self.memories, self.ties)

    def breakdown(self, assign: list[int]) -> list[OpBreakdown]:
        """Per-op time and memory of an assignment; layout conversions are charged to the consumer."""
        rows = []
        for v, k in enumerate(self.signature):
            i = assign[v]
            rows.append(OpBreakdown(float(self.computes[k][i]), float(self.comms[k][i]), float(self.memories[k][i])))
        for f in self.edges:
            s, d = f.scope
            rows[d].comm_s += float(f.table[assign[s], assign[d]])
        return rows


def build_problem(graph: Graph, costs: CostModel, lam: float = 0.0, w: Weights = UNPIPELINED,
                  memory_only: bool = False) -> Problem:
    """One variable per op (its configuration index); unary, edge and tie tables as factors.

    Tables are shared between ops of equal signature (same arrays), which is what lets the DP
    recognise identical blocks. `memory_only`: the objective is memory alone (no time, no
    edges), for the least-memory assignment that keeps every tie.
    """
    parts = ProblemParts.of(graph, costs, w)
    return parts.memory_only() if memory_only else parts.at(lam)


def breakdown(graph: Graph, costs: CostModel, assign: list[int], w: Weights = UNPIPELINED) -> list[OpBreakdown]:
    """Per-op time and memory of an assignment; layout conversions are charged to the consumer."""
    return ProblemParts.of(graph, costs, w, ties=False).breakdown(assign)
