"""The planner's entry points: search meshes, stages and per-op configurations; emit a Plan.

Outer loop: every mesh pp x dp x tp = p (within max_tp / max_pp), pipeline micro-batch counts
(pipeline.py), visited by an exact branch and bound (outer.py) that skips candidates whose lower
bound exceeds the fastest fitting one. Inner: the exact per-op DP (dp.py) on each stage's graph. Memory is a hard
limit: the DP minimises time + lambda x memory, lambda found by doubling then bisection; among
every solution met (and the baselines) the fastest one that fits wins. The DP is exact for each
lambda; the constrained choice is exact among those candidates (a Lagrangian relaxation).

Restricted graphs (ops declaring `tp_dims`, tie groups, planner/graph.py; gpt_graph declares
what the trainer executes): the space searched is exactly the assignments in which every op
splits over "tp" only what it allows and every tie holds. Per-op restrictions are applied when
configurations are generated (planner/configs.py); ties are +inf/0 tables in the DP
(planner/problem.py), so each DP is still the exact optimum of its objective over that space
(tests/test_planner_ties.py checks it against brute force and against the trainer's own check).
Pipelines solve stages separately, so tie groups a stage split can cut are fixed on or off per
candidate (`TieVariants`), every state searched. Graphs that declare nothing are searched as
before: same configurations, same tables, same plans.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import product
from typing import Literal

from planner import dp
from planner.baselines import baseline_assign, baseline_meshes
from planner.configs import Mesh, counts_mesh, dtensor_placements, mesh_configs, named_mesh
from planner.costs import CostModel
from planner.execution import executable
from planner.graph import Graph, Op
from planner.problem import UNPIPELINED, OpBreakdown, Weights, breakdown, build_problem, tie_factors
from planner.profile import ModelProfile, profile_graph
from specs.plan import OpPlacement, Plan

Method = Literal["dp", "exhaustive"]


@dataclass
class StageResult:
    """One stage's chosen configurations and what they cost."""

    graph: Graph
    costs: CostModel
    assign: list[int]
    weights: Weights
    rows: list[OpBreakdown]
    lam: float = 0.0

    @property
    def mesh(self) -> Mesh:
        return self.costs.mesh

    @property
    def time_s(self) -> float:
        return sum(r.compute_s + r.comm_s for r in self.rows)

    @property
    def memory_bytes(self) -> float:
        return sum(r.memory_bytes for r in self.rows)


@dataclass
class Candidate:
    """A whole strategy: mesh degrees, micro-batches, stages; its step time and memory."""

    name: str
    pp: int
    dp: int
    tp: int
    micro_batches: int
    stages: list[StageResult]
    time_s: float
    memory_bytes: float
    notes: list[str] = field(default_factory=list)

    def fits(self, limit: float | None) -> bool:
        return limit is None or self.memory_bytes <= limit


def _solve(problem: dp.Problem, method: Method) -> list[int]:
    return (dp.solve(problem) if method == "dp" else dp.brute_force(problem))[0]


def _result(graph: Graph, costs: CostModel, assign: list[int], w: Weights, lam: float) -> StageResult:
    return StageResult(graph, costs, assign, w, breakdown(graph, costs, assign, w), lam)


class StageSolver:
    """`solve_stage` in steps, so an outer search can stop early (planner/outer.py).

    `floor()`: the least-memory solution that keeps the graph's ties (an exact test: memory is a
    sum of per-op terms; the DP over memory alone when per-op minima break a tie);
    `first()`: the lambda = 0 solution, the fastest with no memory limit (a lower bound on the
    stage time of every solution); `finish()`: the bisection, as `solve_stage` returns it.
    Each step runs once and is kept.
    """

    def __init__(self, graph: Graph, costs: CostModel, memory_limit: float | None, w: Weights = UNPIPELINED,
                 method: Method = "dp") -> None:
        self.graph, self.costs, self.limit, self.w, self.method = graph, costs, memory_limit, w, method
        self._floor: StageResult | None = None
        self._first: StageResult | None = None
        self._done: tuple[StageResult, list[StageResult]] | None = None

    def floor(self) -> StageResult:
        if self._floor is None:
            g, costs, w = self.graph, self.costs, self.w
            least = [int((c.param_mem + w.inflight * c.act_mem).argmin()) for c in map(costs.op_cost, g.ops)]
            ties = tie_factors(g, costs)
            if ties and not math.isfinite(dp.evaluate(dp.Problem([], ties), least)):
                # Each op's least-memory configuration breaks a tie: the exact least-memory
                # assignment that keeps them all (memory is a sum of per-op terms, ties pairwise).
                least = dp.solve(build_problem(g, costs, w=w, memory_only=True))[0]
            self._floor = _result(g, costs, least, w, float("inf"))
        return self._floor

    def infeasible(self) -> bool:
        """No assignment fits the memory limit."""
        return self.limit is not None and self.floor().memory_bytes > self.limit

    def first(self) -> StageResult:
        if self._first is None:
            g, costs, w = self.graph, self.costs, self.w
            self._first = _result(g, costs, _solve(build_problem(g, costs, 0.0, w), self.method), w, 0.0)
        return self._first

    def finish(self) -> tuple[StageResult, list[StageResult]]:
        if self._done is None:
            self._done = self._finish()
        return self._done

    def _finish(self) -> tuple[StageResult, list[StageResult]]:
        graph, costs, w, memory_limit, method = self.graph, self.costs, self.w, self.limit, self.method
        if memory_limit is not None and self.infeasible():
            return self.floor(), [self.floor()]
        first = self.first()
        seen = [first]
        if memory_limit is None or first.memory_bytes <= memory_limit:
            return first, seen

        def at(lam: float) -> StageResult:
            res = _result(graph, costs, _solve(build_problem(graph, costs, lam, w), method), w, lam)
            seen.append(res)
            return res

        scale = first.time_s / max(first.memory_bytes, 1.0)
        lo, hi = 0.0, scale * 1e-3
        while True:  # doubling until the memory fits or lambda makes time irrelevant
            res = at(hi)
            if res.memory_bytes <= memory_limit or hi > scale * 1e9:
                break
            lo, hi = hi, hi * 4.0
        if res.memory_bytes <= memory_limit:
            for _ in range(5):  # bisection in log space for the smallest fitting lambda
                mid = math.sqrt(hi * lo) if lo > 0 else hi / 4.0
                if at(mid).memory_bytes <= memory_limit:
                    hi = mid
                else:
                    lo = mid
        fitting = [r for r in seen if r.memory_bytes <= memory_limit]
        best = min(fitting, key=lambda r: r.time_s) if fitting else min(seen, key=lambda r: r.memory_bytes)
        return best, seen


def solve_stage(graph: Graph, costs: CostModel, memory_limit: float | None, w: Weights = UNPIPELINED,
                method: Method = "dp") -> tuple[StageResult, list[StageResult]]:
    """The fastest configurations that fit `memory_limit`, and every solution met on the way.

    When none fits, the first element is the least-memory solution (check its memory).
    """
    return StageSolver(graph, costs, memory_limit, w, method).finish()


def divisors(n: int) -> list[int]:
    """The divisors of n, ascending, in O(sqrt n) steps (a loop up to n hangs at n = 1e9)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def mesh_degrees(devices: int, max_tp: int | None, max_pp: int | None) -> list[tuple[int, int, int]]:
    """Every (pp, dp, tp) with pp x dp x tp = devices within the limits."""
    out = []
    for pp in divisors(devices):
        if pp > (max_pp or devices):
            continue
        for tp in divisors(devices // pp):
            if tp <= (max_tp or devices):
                out.append((pp, devices // pp // tp, tp))
    return out


def _as_profile(source: ModelProfile | Graph, device_kind: str, devices_per_node: int | None) -> ModelProfile:
    if isinstance(source, ModelProfile):
        if devices_per_node is not None:
            source = source.model_copy(update={"comm": source.comm.model_copy(update={"devices_per_node": devices_per_node})})
        return source
    return profile_graph(source, device_kind, devices_per_node=devices_per_node)


def single_stage(profile: ModelProfile, dp_: int, tp: int, limit: float | None, method: Method) -> Candidate:
    """The best unpipelined strategy on a dp x tp mesh."""
    g = profile.graph
    mesh = named_mesh(dp_, tp, profile.comm.devices_per_node, g.batch_dim)
    res, _ = solve_stage(g, CostModel(g, profile.device, profile.comm, mesh), limit, method=method)
    return Candidate("pase-dp" if method == "dp" else "exhaustive", 1, dp_, tp, 1, [res], res.time_s, res.memory_bytes)


def baselines(profile: ModelProfile, devices: int, max_tp: int | None) -> dict[str, Candidate | None]:
    """Data parallel and Megatron on the same cost model (None: a split does not divide)."""
    g = profile.graph
    out: dict[str, Candidate | None] = {}
    for name, mesh in baseline_meshes(g, devices, profile.comm.devices_per_node, max_tp).items():
        costs = CostModel(g, profile.device, profile.comm, mesh)
        assign = baseline_assign(g, costs)
        if assign is None:
            out[name] = None
            continue
        ties = tie_factors(g, costs)
        if ties and not math.isfinite(dp.evaluate(dp.Problem([], ties), assign)):
            out[name] = None  # it breaks a tie group: a layout the trainer refuses is no candidate
            continue
        res = _result(g, costs, assign, UNPIPELINED, 0.0)
        tp = dict(zip(mesh.names, mesh.sizes, strict=True)).get("tp", 1)
        out[name] = Candidate(name, 1, devices // tp, tp, 1, [res], res.time_s, res.memory_bytes)
    return out


class TieVariants:
    """The graphs pipelined candidates are searched on: one per on/off state of the tie groups
    that a stage split may cut (`Graph.spanning_tp_groups`), each with a note naming its state.

    Stages are solved one at a time, so the per-stage DP cannot keep a tie between ops of two
    stages; fixing those groups beforehand (`Graph.with_tp_states`) and searching every state
    as its own candidate keeps the search exact. A state is skipped on a mesh where some op it
    forces on has no even split over "tp" at one of the micro-batch sizes searched (exact for
    ties whose `tp_dims` do not include the batch dim, as in gpt_graph; otherwise that state is
    left out on that mesh). Unpipelined candidates (one stage) and meshes without a "tp" axis
    keep the graph as it is: there every tie is a DP constraint (planner/problem.py).
    Variant graphs are built once per state.
    """

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.groups = graph.spanning_tp_groups()
        self._variants: dict[tuple[bool, ...], tuple[Graph, list[Op], str]] = {}

    def _variant(self, bits: tuple[bool, ...]) -> tuple[Graph, list[Op], str]:
        if bits not in self._variants:
            states = dict(zip(self.groups, bits, strict=True))
            g = self.graph.with_tp_states(states)
            forced = {op.signature(): op for op in g.ops if op.tp_required}
            note = "tie groups across stages: " + ", ".join(f"{n} {'on' if b else 'off'}" for n, b in states.items())
            self._variants[bits] = (g, list(forced.values()), note)
        return self._variants[bits]

    def for_mesh(self, pp: int, dp_: int, tp: int, devices_per_node: int) -> list[tuple[Graph, str | None]]:
        g = self.graph
        if pp == 1 or tp == 1 or not self.groups or g.batch_dim not in g.ops[0].dims:
            return [(g, None)]
        from planner.pipeline import micro_batch_options

        mesh = named_mesh(dp_, tp, devices_per_node, g.batch_dim)
        batch = g.ops[0].dims[g.batch_dim]
        sizes = [batch // m for m in micro_batch_options(batch, pp, dp_)]
        out: list[tuple[Graph, str | None]] = []
        for bits in product((False, True), repeat=len(self.groups)):
            variant, forced, note = self._variant(bits)
            if all(mesh_configs(variant.op_with_batch(op, n), mesh) for op in forced for n in sizes):
                out.append((variant, note))
        return out


# Branch and bound over the outer loop (planner/outer.py); False: the plain enumeration below,
# which visits every candidate (the reference the tests compare the pruned search with).
PRUNE = True


def candidates(profile: ModelProfile, devices: int, limit: float | None, max_tp: int | None,
               max_pp: int | None, method: Method, incumbent: float = float("inf"),
               prune: bool | None = None, skip_unfit: bool = True) -> list[Candidate]:
    """Every mesh's best strategy (pipelined ones through planner.pipeline).

    Pruned (`prune`, default `PRUNE`): only the candidates that may be the fastest fitting one,
    given a fitting strategy of time `incumbent` (see planner/outer.py); the fastest fitting
    candidate, and the first among equals, is the same either way.
    """
    if PRUNE if prune is None else prune:
        from planner.outer import branch_and_bound

        return branch_and_bound(profile, devices, limit, max_tp, max_pp, method, incumbent)
    from planner.pipeline import pipelined

    g = profile.graph
    ties = TieVariants(g)
    out = []
    for pp, dp_, tp in mesh_degrees(devices, max_tp, max_pp):
        if skip_unfit and limit is not None and g.n_params * g.param_state_bytes / (tp * pp) > limit:
            continue  # weights split at most tp x pp ways ("dp" splits only the batch): cannot fit
        if pp == 1:
            best = single_stage(profile, dp_, tp, limit, method)
            out.append(best)
            if best.fits(limit):
                continue
        # pp == 1 here: gradient accumulation over micro-batches, to cut activation memory.
        for variant, note in ties.for_mesh(pp, dp_, tp, profile.comm.devices_per_node):
            found = pipelined(profile if variant is g else profile.model_copy(update={"graph": variant}),
                              pp, dp_, tp, limit, method, skip_unfit)
            for cand in found if note else ():
                cand.notes.append(note)
            out.extend(found)
    return out


def to_plan(best: Candidate, devices: int, base: dict[str, Candidate | None], limit: float | None,
            graph: Graph) -> Plan:
    """The Plan the trainer executes (planner.execution: its per-op choice in the trainer's
    terms), annotated with per-op costs and DTensor placements."""
    placements, stages = [], []
    for s, st in enumerate(best.stages):
        names = []
        for op, i, row in zip(st.graph.ops, st.assign, st.rows, strict=True):
            cfg = st.costs.op_cost(op).configs[i]
            placements.append(OpPlacement(
                op=op.name, splits=cfg.splits(op, st.mesh), stage=s, compute_s=row.compute_s, comm_s=row.comm_s,
                memory_bytes=int(row.memory_bytes), dtensor=dtensor_placements(op, cfg, st.mesh)))
            names.append(op.name)
        stages.append(names)
    notes = list(best.notes)
    for name, cand in base.items():
        if cand is None:
            notes.append(f"{name} baseline: not executable here (a split does not divide, or it breaks a tie group)")
        elif not cand.fits(limit):
            notes.append(f"{name} baseline needs {cand.memory_bytes / 2**30:.1f} GiB per device, over the limit")
    feasible = best.fits(limit)
    if not feasible:
        notes.append(f"no strategy fits {limit / 2**30:.1f} GiB per device")
    mesh = {axis: n for axis, n in (("pp", best.pp), ("dp", best.dp), ("tp", best.tp)) if n > 1} or {"dp": 1}
    return executable(Plan(
        devices=devices, mesh=mesh, placements=placements, micro_batches=best.micro_batches,
        estimated_step_s=best.time_s, memory_per_device_bytes=int(best.memory_bytes), strategy=best.name,
        baselines={k: c.time_s for k, c in base.items() if c is not None},
        baseline_memory_bytes={k: int(c.memory_bytes) for k, c in base.items() if c is not None},
        stages=stages if len(stages) > 1 else [], feasible=feasible, notes=notes,
    ), graph)


def plan_model(source: ModelProfile | Graph, devices: int, memory_limit_bytes: int | None = None,
               max_tp: int | None = None, max_pp: int | None = None, *, device_kind: str = "cuda",
               devices_per_node: int | None = None, method: Method = "dp") -> Plan:
    """The fastest strategy under the cost model that fits the memory limit, as a Plan.

    `memory_limit_bytes` None: the profile's device memory (unlimited if unknown). Baselines are
    evaluated on the same cost model; a fitting baseline that is faster than every searched
    candidate would be chosen, which cannot happen since both lie in the searched space.
    """
    profile = _as_profile(source, device_kind, devices_per_node)
    limit = memory_limit_bytes if memory_limit_bytes is not None else profile.device.memory_bytes
    base = baselines(profile, devices, max_tp)
    known = min((c.time_s for c in base.values() if c is not None and c.fits(limit)), default=float("inf"))
    pool = candidates(profile, devices, limit, max_tp, max_pp, method, known)
    pool += [c for c in base.values() if c is not None]
    fitting = [c for c in pool if c.fits(limit)]
    if fitting:
        return to_plan(min(fitting, key=lambda c: c.time_s), devices, base, limit, profile.graph)
    # Nothing fits: say so, and return the layout closest to fitting (least memory, then time),
    # with the memory it needs (feasible=False). Searched with the limit, every stage that cannot
    # fit is its least-memory assignment; the bound on weights skips no mesh here.
    g = profile.graph
    floor = g.n_params * g.param_state_bytes / devices
    pool = candidates(profile, devices, limit, max_tp, max_pp, method, prune=False, skip_unfit=False)
    pool += [c for c in base.values() if c is not None]
    best = min(pool, key=lambda c: (c.memory_bytes, c.time_s))
    best.notes.append(f"nothing fits {limit / 2**30:.1f} GiB per device: this is the layout closest to fitting, "
                      f"needing {best.memory_bytes / 2**30:.1f} GiB per device (weights and optimizer state alone "
                      f"need >= {floor / 2**30:.1f} GiB even split {devices} ways)")
    return to_plan(best, devices, base, limit, profile.graph)


def exhaustive_search(source: ModelProfile | Graph, devices: int, memory_limit_bytes: int | None = None,
                      max_tp: int | None = None, max_pp: int | None = None, **kwargs: object) -> Plan:
    """`plan_model` with brute force in place of the DP, over the same space (small graphs only)."""
    return plan_model(source, devices, memory_limit_bytes, max_tp, max_pp, method="exhaustive", **kwargs)


def search_counts(graph: Graph, profile: ModelProfile, devices: int, method: Method = "dp",
                  full: bool = False) -> StageResult:
    """PaSE's own space (per-dim split counts, aligned layouts), unconstrained: for benchmarks."""
    mesh = counts_mesh(devices, profile.comm.devices_per_node, full)
    res, _ = solve_stage(graph, CostModel(graph, profile.device, profile.comm, mesh), None, method=method)
    return res


def plan_options(source: ModelProfile | Graph, devices: int, memory_limit_bytes: int | None = None,
                 max_tp: int | None = None, max_pp: int | None = None, *, device_kind: str = "cuda",
                 devices_per_node: int | None = None) -> list[Plan]:
    """The search's choice and every baseline that fits, as Plans, fastest first: for a choice
    that weighs more than step time (re-planning a running job also pays for moving its
    checkpoint onto the new plan, which differs from plan to plan)."""
    best = plan_model(source, devices, memory_limit_bytes, max_tp, max_pp, device_kind=device_kind,
                      devices_per_node=devices_per_node)
    profile = _as_profile(source, device_kind, devices_per_node)
    limit = memory_limit_bytes if memory_limit_bytes is not None else profile.device.memory_bytes
    base = baselines(profile, devices, max_tp)
    options = [best] + [to_plan(c, devices, base, limit, profile.graph) for c in base.values() if c is not None and c.fits(limit)]
    unique: dict[tuple[object, ...], Plan] = {}
    for plan in options:
        key = (tuple(sorted(plan.mesh.items())), tuple((p.op, tuple(sorted(p.splits.items()))) for p in plan.placements))
        unique.setdefault(key, plan)
    return sorted(unique.values(), key=lambda p: p.estimated_step_s if p.estimated_step_s is not None else float("inf"))
