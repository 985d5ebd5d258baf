"""The outer search: one enumeration of meshes, micro-batch counts and stage splits, two visits.

`enumerate_specs` lists every candidate of the space (mesh pp x dp x tp, micro-batch count,
stage split, tie state), unevaluated. `evaluate_all` solves every one (the constrained search of
`stage.StageSolver` on each distinct stage); `branch_and_bound` visits the same candidates, best
lower bound first, and drops those that provably cannot beat the fastest fitting candidate met
so far (the incumbent; the fitting baselines seed it). It is exact: the best candidate, and the
first one in enumeration order among equals, is the same as `evaluate_all`'s
(tests/test_planner_outer.py checks this). Stage objectives are `problem.Weights`' terms and a
pipeline's step is `pipeline.step_time`, for both visits and every bound.

Lower bounds on a candidate's step time, max over its stages of the stage time plus the
stage-boundary transfer, all valid because every cost term is non-negative:

1. per stage, the sum over its ops of each op's cheapest time (compute, collectives, gradient
   sync) with the layout conversions left out: no DP, a few array minima per distinct op;
2. per stage, the lambda = 0 DP optimum (the fastest assignment with no memory limit), which
   the constrained search's answer can never beat; the least-memory assignment on the way is an exact
   fit test (a stage that cannot fit makes the whole candidate useless under a limit);
3. while finishing a candidate's stages, each finished stage's lower bound (its time where it
   is proven optimal) plus the boundary.

Memoisation: a context (mesh, micro-batch count) builds its micro-batch graph and cost tables
once, and solves each distinct stage (same ops, edges and tie structure up to names) once,
whichever split it comes from; stage splits and their keys are computed once per pipeline depth
and tie state (`stage.TieVariants`: pipelined candidates are enumerated once per on/off state
of the tie groups a stage split can cut), independent of mesh and micro-batch size.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from parashift.planner.configs import TP, mesh_configs, named_mesh
from parashift.planner.costs import CostModel
from parashift.planner.graph import Graph, Op
from parashift.planner.pipeline import block_order, boundary_s, stage_ops, stage_splits, step_time
from parashift.planner.problem import Weights
from parashift.planner.profile import ModelProfile
from parashift.planner.stage import (
    Candidate,
    Method,
    StageResult,
    StageSolver,
    TieVariants,
    micro_batch_options,
    searched_meshes,
    weights_floor,
)

# Relative slack on the incumbent: bounds and times are sums in different orders.
EPS = 1e-9


@dataclass
class _Layout:
    """One stage split of the full graph: op names, structural keys and boundary sources per stage."""

    counts: list[int]
    names: list[list[str]]
    keys: list[tuple]
    sig_counts: list[tuple[tuple[str, int], ...]]  # per stage: (op signature, ops with it)
    crossing: list[str]  # producers of edges that cross a stage boundary


def _sig_counts(names: list[str], sig: dict[str, str]) -> tuple[tuple[str, int], ...]:
    out: dict[str, int] = {}
    for n in names:
        out[sig[n]] = out.get(sig[n], 0) + 1
    return tuple(out.items())


def _tie_key(g: Graph, names: list[str]) -> tuple:
    """A stage's tie structure up to names: per op, its group and the group it needs, numbered
    by first appearance in the stage (signatures leave ties out, planner/graph.py)."""
    ops = {op.name: op for op in g.ops}
    label: dict[str, int] = {}
    out = []
    for n in names:
        op = ops[n]
        out.append(tuple(label.setdefault(x, len(label)) if x is not None else -1 for x in (op.tp_group, op.tp_needs)))
    return tuple(out) if label else ()


def _layouts(g: Graph, blocks: list[str], pp: int, sig: dict[str, str]) -> list[_Layout]:
    out = []
    for counts in stage_splits(len(blocks), pp):
        names = stage_ops(g, blocks, counts)
        where = {n: s for s, stage in enumerate(names) for n in stage}
        pos = {n: i for stage in names for i, n in enumerate(stage)}
        inner: list[list[tuple[int, int, int]]] = [[] for _ in names]
        crossing = []
        for e in g.edges:
            if where[e.src] == where[e.dst]:
                inner[where[e.dst]].append((pos[e.src], pos[e.dst], e.slot))
            else:
                crossing.append(e.src)
        keys = [(tuple(sig[n] for n in stage), tuple(edges), _tie_key(g, stage))
                for stage, edges in zip(names, inner, strict=True)]
        out.append(_Layout(counts, names, keys, [_sig_counts(n, sig) for n in names], crossing))
    return out


class _Resized(Mapping[str, Op]):
    """Op name -> the op at a batch size, resized on first use (most contexts are pruned on
    their lower bounds, which read one op per signature). One per graph and size, shared by
    every mesh's context at that size: a resized op depends on nothing else."""

    def __init__(self, g: Graph, size: int | None) -> None:
        self.g, self.size = g, size
        self.base = {op.name: op for op in g.ops}
        self.done: dict[str, Op] = {}
        self._graph: Graph | None = None

    @property
    def graph(self) -> Graph:
        """The whole graph at this size."""
        if self._graph is None:
            g = self.g
            self._graph = g if self.size is None else g.model_copy(update={"ops": [self[n] for n in self]})
        return self._graph

    def __getitem__(self, name: str) -> Op:
        if self.size is None:
            return self.base[name]
        if name not in self.done:
            self.done[name] = self.g.op_with_batch(self.base[name], self.size)
        return self.done[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.base)

    def __len__(self) -> int:
        return len(self.base)


class _Context:
    """One mesh and micro-batch size (None: the full batch): cost tables, distinct stages, and
    the resized graph, built only when a stage is solved."""

    def __init__(self, profile: ModelProfile, g: Graph, dp: int, tp: int, size: int | None, w: Weights,
                 limit: float | None, method: Method, sig: dict[str, str], ops: _Resized | None = None) -> None:
        mesh = named_mesh(dp, tp, profile.comm.devices_per_node, g.batch_dim, profile.shard_dp)
        self.base, self.size, self.w, self.limit, self.method, self.sig = g, size, w, limit, method, sig
        # Workers sharing cores: a pipeline's step is at least this share of its slowest stage
        # (planner.pipeline.step_time), so stage bounds scale by it (1 on GPUs: unchanged).
        self.share = profile.device.core_share
        self.ops = ops if ops is not None else _Resized(g, size)
        # Signatures of the resized ops: the full graph's, tagged with the batch size (an op's
        # resized copy is a function of the original and the size), so no re-hashing per size.
        sigs = sig if size is None else {n: f"{s}@{size}" for n, s in sig.items()}
        # Byte sizes are the graph's, whatever the batch; ops come resized from `self.ops`.
        self.costs = CostModel(g, profile.device, profile.comm, mesh, signatures=sigs, ops=self.ops)
        self._profile, self._mesh, self._sigs = profile, mesh, sigs
        self._least: dict[str, float] = {}
        self._rep = {}
        for op in g.ops:
            self._rep.setdefault(sig[op.name], op.name)
        self._forced = {sig[op.name]: op.name for op in g.ops if op.tp_required}
        self.stages: dict[tuple, _Stage] = {}

    def configurable(self) -> bool:
        """Whether every op has a configuration here. Only an op that must split over "tp"
        (`tp_required`) can lack one, where none of its dims splits evenly at this batch size
        (planner/configs.py `mesh_configs`): then the mesh is no candidate, but others are."""
        mesh = self.costs.mesh
        return TP not in mesh.names or all(mesh_configs(self.ops[n], mesh) for n in self._forced.values())

    @property
    def graph(self) -> Graph:
        return self.ops.graph

    def least_time(self, sig: str) -> float:
        """The cheapest time per step of ops of signature `sig` (layout conversions aside)."""
        if sig not in self._least:
            self._least[sig] = float(self.w.time(self.costs.op_cost(self.ops[self._rep[sig]])).min())
        return self._least[sig]

    def stage_costs(self, names: list[str]) -> CostModel:
        """The cost tables a stage of `names` is solved with: the context's, except that a
        checkpointed stage recomputes one of its own layers at a time (`Graph.subgraph`)."""
        sub = self.base.subgraph(names)
        if sub.recompute_layers == self.base.recompute_layers:
            return self.costs
        return CostModel(sub, self._profile.device, self._profile.comm, self._mesh, signatures=self._sigs,
                         ops=self.ops)

    def stage(self, key: tuple, names: list[str], counts: tuple[tuple[str, int], ...]) -> _Stage:
        if key not in self.stages:
            self.stages[key] = _Stage(self, names, sum(n * self.least_time(s) for s, n in counts))
        return self.stages[key]


class _Stage:
    """A distinct stage of a context; solved (lazily, in steps) once for every split using it."""

    def __init__(self, ctx: _Context, names: list[str], lb: float) -> None:
        self.ctx, self.names, self.lb = ctx, names, lb
        self._solver: StageSolver | None = None

    @property
    def solver(self) -> StageSolver:
        if self._solver is None:
            ctx = self.ctx
            whole = len(self.names) == len(ctx.base.ops)
            sub = ctx.graph if whole else ctx.graph.subgraph(self.names)
            costs = ctx.costs if whole else ctx.stage_costs(self.names)
            self._solver = StageSolver(sub, costs, ctx.limit, ctx.w, ctx.method)
        return self._solver


@dataclass
class CandidateSpec:
    """One candidate of the plain enumeration, not yet (or partly) evaluated."""

    order: int
    pp: int
    dp: int
    tp: int
    m: int
    ctx: _Context
    stages: list[_Stage]
    boundary: float
    layout: _Layout | None = None  # None: the unpipelined single stage
    cond: CandidateSpec | None = None  # pp = 1 accumulation: only when the single stage does not fit
    tie_note: str | None = None  # the tie groups fixed for this candidate (stage.TieVariants)
    lb: float = 0.0
    fits: bool | None = None  # known once evaluated (single stages)
    done: bool = False
    result: Candidate | None = None
    distinct: list[_Stage] = field(default_factory=list)

    def __post_init__(self) -> None:
        seen: dict[int, _Stage] = {}
        for st in self.stages:
            seen.setdefault(id(st), st)
        self.distinct = list(seen.values())
        self.lb = self.ctx.share * max(st.lb for st in self.distinct) + self.boundary

    def notes(self) -> list[str]:
        """The candidate's notes: its stage split and micro-batches, and the tie state fixed."""
        if self.layout is None:
            return []
        note = (f"stages of {self.layout.counts} blocks, {self.m} micro-batches (1F1B)" if self.pp > 1 else
                f"one stage, {self.m} micro-batches (gradient accumulation)")
        return [note, self.tie_note] if self.tie_note else [note]


def enumerate_specs(profile: ModelProfile, devices: int, limit: float | None, max_tp: int | None,
                    max_pp: int | None, method: Method, skip_unfit: bool = True) -> list[CandidateSpec]:
    """Every candidate of the search space, unevaluated, in the order that breaks ties.

    Per mesh (pp, dp, tp): the unpipelined single stage (pp = 1), then per tie state, micro-batch
    count and stage split a pipelined candidate (pp = 1 with several micro-batches: gradient
    accumulation, searched only if the single stage does not fit). `skip_unfit`: leave out
    meshes whose parameter state alone exceeds the limit (False: keep them, to find the layout
    closest to fitting when nothing fits).
    """
    g = profile.graph
    sig = {op.name: op.signature() for op in g.ops}
    blocks = block_order(g)
    ties = TieVariants(g)
    sigs: dict[int, dict[str, str]] = {id(g): sig}  # per variant graph
    layouts: dict[tuple[int, int], list[_Layout]] = {}
    resized: dict[tuple[int, int], _Resized] = {}  # (variant graph, micro-batch size): shared by every mesh
    specs: list[CandidateSpec] = []
    floor = weights_floor(profile)
    for pp, dp_, tp in searched_meshes(profile, devices, max_tp, max_pp):
        if skip_unfit and limit is not None and floor(pp, dp_, tp) > limit:
            continue
        single = None
        if pp == 1:
            ctx = _Context(profile, g, dp_, tp, None, Weights.schedule(1, 1, profile.reshard_after_forward),
                           limit, method, sig)
            names = [op.name for op in g.ops]
            if ctx.configurable():
                stage = ctx.stage(("single",), names, _sig_counts(names, sig))
                single = CandidateSpec(len(specs), 1, dp_, tp, 1, ctx, [stage], 0.0)
                specs.append(single)
        if len(blocks) < pp or g.batch_dim not in g.ops[0].dims:
            continue  # no blocks to cut into stages, or no batch to cut into micro-batches
        batch = g.ops[0].dims[g.batch_dim]
        for gv, note in ties.for_mesh(pp, dp_, tp, profile.comm.devices_per_node):
            if id(gv) not in sigs:
                sigs[id(gv)] = {op.name: op.signature() for op in gv.ops}
            sv = sigs[id(gv)]
            if (pp, id(gv)) not in layouts:
                layouts[pp, id(gv)] = _layouts(gv, blocks, pp, sv)
            for m in micro_batch_options(batch, pp, dp_):
                if pp == 1 and m == 1:
                    continue  # the single stage above
                w = Weights.schedule(pp, m, profile.reshard_after_forward)
                if (id(gv), batch // m) not in resized:
                    resized[id(gv), batch // m] = _Resized(gv, batch // m)
                ctx = _Context(profile, gv, dp_, tp, batch // m, w, limit, method, sv, resized[id(gv), batch // m])
                if not ctx.configurable():
                    continue
                for lay in layouts[pp, id(gv)]:
                    stages = [ctx.stage(*x) for x in zip(lay.keys, lay.names, lay.sig_counts, strict=True)]
                    worst = 0.0  # the largest activation crossing a stage boundary
                    for src in lay.crossing:
                        op = ctx.ops[src]
                        worst = max(worst, float(op.numel(op.output) * g.act_bytes))
                    boundary = boundary_s(profile.comm, worst, pp, dp_, tp, m)
                    specs.append(CandidateSpec(len(specs), pp, dp_, tp, m, ctx, stages, boundary, lay, single, tie_note=note))
    return specs


def _single(spec: CandidateSpec, cutoff: float = float("inf")) -> Candidate:
    res, _ = spec.stages[0].solver.finish(cutoff)
    name = "pase-dp" if spec.ctx.method == "dp" else "exhaustive"
    return Candidate(name, 1, spec.dp, spec.tp, 1, [res], res.time_s, res.memory_bytes, proven=res.proven,
                     bound_s=res.bound)


def _pipelined(spec: CandidateSpec, bound: float | None) -> Candidate | None:
    """The candidate; with a `bound`, None as soon as a finished stage makes it slower than
    `bound` or too large for the limit."""
    ctx, limit = spec.ctx, spec.ctx.limit
    if bound is not None:
        for st in sorted(spec.distinct, key=lambda s: -s.solver.time_floor()):
            res, _ = st.solver.finish((bound - spec.boundary) / ctx.share)
            if limit is not None and res.memory_bytes > limit:
                return None
            if ctx.share * res.bound + spec.boundary > bound:
                return None
    results = []
    for st, names in zip(spec.stages, spec.layout.names, strict=True):
        r = st.solver.finish()[0]
        sub = st.solver.graph if names is st.names else ctx.graph.subgraph(names)
        results.append(StageResult(sub, ctx.costs, r.assign, ctx.w, r.rows, r.lam, r.bound, r.proven))
    time_s = step_time(results, spec.m, spec.boundary, ctx.share)
    memory = max(r.memory_bytes for r in results)
    name = ("pase-dp" if ctx.method == "dp" else "exhaustive") + ("+pipeline" if spec.pp > 1 else "+accumulation")
    return Candidate(name, spec.pp, spec.dp, spec.tp, spec.m, results, time_s, memory, spec.notes(),
                     proven=all(r.proven for r in results),
                     bound_s=ctx.share * max(r.bound for r in results) + spec.boundary, boundary_s=spec.boundary)


def evaluate(spec: CandidateSpec) -> Candidate:
    """One candidate, every stage solved."""
    cand = _single(spec) if spec.layout is None else _pipelined(spec, None)
    assert cand is not None
    return cand


def evaluate_all(specs: list[CandidateSpec], limit: float | None) -> list[Candidate]:
    """Every candidate, in enumeration order (the reference that `branch_and_bound` is tested
    against); accumulation only on meshes whose single stage does not fit."""
    out = []
    for spec in specs:
        if spec.cond is not None and spec.cond.fits:
            continue
        cand = evaluate(spec)
        if spec.layout is None:
            spec.fits = cand.fits(limit)
        out.append(cand)
    return out


def branch_and_bound(specs: list[CandidateSpec], limit: float | None, incumbent: float = float("inf")) -> list[Candidate]:
    """Candidates that may be the fastest fitting one (every one that ties with or beats
    `incumbent`, the time of a fitting strategy known beforehand), in enumeration order.
    Under a memory limit only fitting candidates are returned; with none, every survivor."""
    best = incumbent

    def bound() -> float:
        return best + EPS * abs(best)

    def settle(spec: CandidateSpec, cand: Candidate | None) -> None:
        nonlocal best
        spec.done, spec.result = True, cand
        if cand is not None and cand.fits(limit):
            best = min(best, cand.time_s)

    def single_fits(spec: CandidateSpec) -> bool:
        if spec.fits is None:
            stage = spec.stages[0]
            if limit is not None and stage.solver.infeasible():
                spec.fits = False
                settle(spec, None)
            else:
                cand = _single(spec, bound())
                spec.fits = cand.fits(limit)
                settle(spec, cand)
        return spec.fits

    heap = [(s.lb, 0, s.order) for s in specs]
    heapq.heapify(heap)
    while heap:
        lb, level, i = heapq.heappop(heap)
        if lb > bound():
            break  # every remaining bound is at least this one
        spec = specs[i]
        if spec.done:
            continue
        if level == 0:
            if limit is not None and any(st.solver.infeasible() for st in spec.distinct):
                if spec.layout is None:
                    spec.fits = False
                settle(spec, None)
                continue
            first = spec.ctx.share * max(st.solver.time_floor() for st in spec.distinct) + spec.boundary
            heapq.heappush(heap, (max(lb, first), 1, i))
            continue
        if spec.layout is None:
            single_fits(spec)
            continue
        if spec.cond is not None and single_fits(spec.cond):
            settle(spec, None)  # the unpipelined candidate fits: accumulation is not searched
            continue
        settle(spec, _pipelined(spec, bound()))
    keep = [s.result for s in specs if s.result is not None]
    return [c for c in keep if c.fits(limit)] if limit is not None else keep
