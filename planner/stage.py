"""One stage's search, and what every outer search shares: candidates, mesh degrees,
micro-batch counts and the tie-state variants of a graph.

`StageSolver` finds one stage's fastest assignment under a memory limit (the exact per-op DP,
dp.py, inside a branch and bound on the Lagrangian, planner/constrained.py); `Candidate` is a
whole strategy. The outer
search (planner/outer.py) and the entry points (planner/search.py) build on these.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import product
from typing import Literal

import numpy as np
from parashift.planner import dp
from parashift.planner.configs import Mesh, mesh_configs, named_mesh
from parashift.planner.constrained import MAX_SOLVES, LagrangianSearch
from parashift.planner.costs import CostModel
from parashift.planner.dp import Domains, restrict, unrestrict
from parashift.planner.graph import Graph, Op
from parashift.planner.problem import UNPIPELINED, OpBreakdown, ProblemParts, Weights, breakdown
from parashift.planner.profile import ModelProfile
from parashift.planner.repair import repair

Method = Literal["dp", "exhaustive"]

# Seconds of DP solves (estimated, deterministically) one stage's constrained search may spend
# before it settles for its best assignment and a lower bound.
STAGE_BUDGET_S = 4.0
# A stage whose assignments times its tables number at most this is enumerated when its
# constrained search runs out of budget (a large duality gap on a small stage): numpy sums that
# many entries in well under a second, and the answer is then exact, not only bounded.
ENUMERATE_WORK = 2e7


@dataclass
class StageResult:
    """One stage's chosen configurations and what they cost."""

    graph: Graph
    costs: CostModel
    assign: list[int]
    weights: Weights
    rows: list[OpBreakdown]
    lam: float = 0.0
    # A lower bound on the time of every assignment of this stage that fits the memory limit,
    # and whether this one is proven to reach it (planner/constrained.py).
    bound: float = 0.0
    proven: bool = True
    # How far below this assignment's objective the DP's minimum may lie: 0 when the DP ran on
    # the whole problem, more when it had to leave out pairwise tables (dp.solve_bounded).
    relaxation_s: float = 0.0

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
    # Whether every stage is proven optimal under the limit; if not, a lower bound on the step
    # time of this candidate's mesh, micro-batches and split with any fitting assignment.
    proven: bool = True
    bound_s: float | None = None
    activation_checkpointing: str = "none"  # of the space it was found in
    boundary_s: float = 0.0  # a pipeline's sends across stage boundaries per step
    stage_ac: list[str] = field(default_factory=list)  # per stage, where chosen per stage (search.per_stage_ac)

    def lower_bound_s(self) -> float:
        return self.time_s if self.proven or self.bound_s is None else min(self.bound_s, self.time_s)

    def fits(self, limit: float | None) -> bool:
        return limit is None or self.memory_bytes <= limit


def _solve(problem: dp.Problem, method: Method) -> dp.Solved:
    if method == "dp":
        return dp.solve_bounded(problem)
    assign, total = dp.brute_force(problem)
    return dp.Solved(assign, total, total)


def stage_result(graph: Graph, costs: CostModel, assign: list[int], w: Weights, lam: float,
                 solved: dp.Solved | None = None, parts: ProblemParts | None = None) -> StageResult:
    """`parts`: the stage's tables, where the caller has them (a search reads many results)."""
    rows = parts.breakdown(assign) if parts is not None else breakdown(graph, costs, assign, w)
    res = StageResult(graph, costs, assign, w, rows, lam)
    if solved is not None and solved.dropped:
        gap = solved.value - solved.lower
        # A bound that meets the answer up to rounding (sums in another order) proves it.
        res.relaxation_s = gap if gap > 1e-9 * abs(solved.value) else 0.0
    return res


class StageSolver:
    """`solve_stage` in steps, so an outer search can stop early (planner/outer.py).

    `floor()`: the least-memory solution that keeps the graph's ties (an exact test: memory is a
    sum of per-op terms; the DP over memory alone when per-op minima break a tie);
    `first()`: the lambda = 0 solution, the fastest with no memory limit (a lower bound on the
    stage time of every solution); `finish()`: the constrained search, as `solve_stage`
    returns it.
    Each step runs once and is kept.
    """

    def __init__(self, graph: Graph, costs: CostModel, memory_limit: float | None, w: Weights = UNPIPELINED,
                 method: Method = "dp") -> None:
        self.graph, self.costs, self.limit, self.w, self.method = graph, costs, memory_limit, w, method
        self._floor: StageResult | None = None
        self._first: StageResult | None = None
        self._done: tuple[StageResult, list[StageResult]] | None = None
        self._parts: ProblemParts | None = None

    @property
    def parts(self) -> ProblemParts:
        """The stage's tables, built once for every lambda and domain its search solves at."""
        if self._parts is None:
            self._parts = ProblemParts.of(self.graph, self.costs, self.w)
        return self._parts

    def _result(self, assign: list[int], lam: float, solved: dp.Solved | None = None) -> StageResult:
        return stage_result(self.graph, self.costs, assign, self.w, lam, solved, self.parts)

    def floor(self) -> StageResult:
        if self._floor is None:
            parts = self.parts
            least = [int(parts.memories[k].argmin()) for k in parts.signature]
            ties = parts.ties
            if ties and not math.isfinite(dp.evaluate(dp.Problem([], ties), least)):
                # Each op's least-memory configuration breaks a tie: the exact least-memory
                # assignment that keeps them all (memory is a sum of per-op terms, ties pairwise).
                least = dp.solve(parts.memory_only())[0]
            self._floor = self._result(least, float("inf"))
        return self._floor

    def infeasible(self) -> bool:
        """No assignment fits the memory limit."""
        return self.limit is not None and self.floor().memory_bytes > self.limit

    def first(self) -> StageResult:
        if self._first is None:
            solved = _solve(self.parts.at(0.0), self.method)
            self._first = self._result(solved.assign, 0.0, solved)
        return self._first

    def time_floor(self) -> float:
        """A lower bound on the stage's time under any limit: the lambda = 0 minimum."""
        first = self.first()
        return first.time_s - first.relaxation_s

    def finish(self, cutoff: float = math.inf) -> tuple[StageResult, list[StageResult]]:
        """`cutoff`: a stage time past which the caller has a faster strategy already; the first
        call's is used (the result is kept), and its `bound` is valid whatever the cutoff."""
        if self._done is None:
            self._done = self._finish(cutoff)
        return self._done

    def _finish(self, cutoff: float) -> tuple[StageResult, list[StageResult]]:
        """The fastest assignment that fits: exact by enumeration (`exhaustive`) or by branch and
        bound on the Lagrangian (planner/constrained.py), which proves it optimal or stops (at
        the cutoff, or its budget) with a lower bound (`StageResult.bound`, `proven`). A stage
        small enough to enumerate (ENUMERATE_WORK) is enumerated when the budget stops it."""
        limit = self.limit
        if limit is not None and self.infeasible():
            return self.floor(), [self.floor()]
        first = self.first()
        if limit is None or first.memory_bytes <= limit:
            first.bound = self.time_floor()
            first.proven = first.relaxation_s == 0.0
            return first, [first]
        if self.method == "exhaustive":
            return self._enumerated(limit)
        memory = [self.parts.memories[k] for k in self.parts.signature]
        search = LagrangianSearch(self._at, self._least, memory, limit, max_solves=self._solve_budget(), cutoff=cutoff,
                                  repair=lambda fast, fitting: self._repaired(memory, fast, fitting))
        out = search.run()
        if not out.proven and out.bound < cutoff and self._enumerable():
            best, _ = self._enumerated(limit)  # out of budget, not past the cutoff: small enough to be exact
            return best, [best, *out.met]
        best = out.best if out.best is not None else self.floor()
        best.bound, best.proven = out.bound, out.proven
        return best, out.met

    def _solve_budget(self) -> int:
        """DP solves the constrained search may run: about STAGE_BUDGET_S seconds' worth, by a
        deterministic estimate of one solve (per table, and per table entry)."""
        problem = self.parts.at(0.0)
        estimate = 3e-5 * len(problem.factors) + 3e-9 * sum(f.table.size for f in problem.factors)
        return max(8, min(MAX_SOLVES, int(STAGE_BUDGET_S / estimate)))

    def _enumerable(self) -> bool:
        problem = self.parts.at(0.0)
        return math.prod(problem.card) * max(1, len(problem.factors)) <= ENUMERATE_WORK

    def _at(self, lam: float, domains: Domains) -> StageResult | None:
        """The DP's minimum of time + lam x memory within `domains` (exact, or bracketed:
        `relaxation_s`); None when no assignment keeps every tie there."""
        if not domains and lam == 0.0:
            return self.first()
        solved = _solve(restrict(self.parts.at(lam), domains), self.method)
        if not math.isfinite(solved.value):
            return None
        return self._result(unrestrict(solved.assign, domains), lam, solved)

    def _repaired(self, memory: list[np.ndarray], fast: StageResult, fitting: StageResult) -> StageResult | None:
        """A fitting assignment walked from `fast` toward `fitting` (planner/repair.py)."""
        assert self.limit is not None
        assign = repair(self.parts.at(0.0), memory, fast.assign, fitting.assign, self.limit)
        return None if assign is None else self._result(assign, 0.0)

    def _least(self, domains: Domains) -> StageResult | None:
        if not domains:
            return self.floor()
        solved = _solve(restrict(self.parts.memory_only(), domains), self.method)
        if not math.isfinite(solved.value):
            return None
        return self._result(unrestrict(solved.assign, domains), math.inf)

    def _enumerated(self, limit: float) -> tuple[StageResult, list[StageResult]]:
        """Every assignment, the fastest that fits (small graphs: the reference of the tests)."""
        found = dp.brute_force_constrained(self.parts.at(0.0), self.parts.memory_only(), limit)
        best = self.floor() if found is None else self._result(found[0], 0.0)
        best.bound, best.proven = best.time_s, True
        return best, [best]


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


def searched_meshes(profile: ModelProfile, devices: int, max_tp: int | None,
                    max_pp: int | None) -> list[tuple[int, int, int]]:
    """The (pp, dp, tp) meshes a space searches: every one, except that the sharded space
    (`profile.shard_dp`) skips dp = 1, where there is nothing to shard and the replicated space
    has the same mesh, and that a space priced for meshes with or without a data axis
    (`profile.data_axis`) searches only those."""
    return [(pp, dp, tp) for pp, dp, tp in mesh_degrees(devices, max_tp, max_pp)
            if (dp > 1 or not profile.shard_dp) and profile.data_axis in (None, dp > 1)]


def weights_floor(profile: ModelProfile) -> Callable[[int, int, int], float]:
    """(pp, dp, tp) -> bytes of parameter state per device at best on that mesh: split tp x pp
    ways, and dp ways more where dp shards it (a mesh below this can never fit a limit).
    Parameters indexed by the batch dim (possible in a user's graph) are split by dp as well."""
    g = profile.graph
    state = profile.n_params * g.param_state_bytes
    by_dp = profile.shard_dp or any(g.batch_dim in dims for op in g.ops for dims in op.params)
    return lambda pp, dp, tp: state / (tp * pp * (dp if by_dp else 1))


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
        mesh = named_mesh(dp_, tp, devices_per_node, g.batch_dim)
        batch = g.ops[0].dims[g.batch_dim]
        sizes = [batch // m for m in micro_batch_options(batch, pp, dp_)]
        out: list[tuple[Graph, str | None]] = []
        for bits in product((False, True), repeat=len(self.groups)):
            variant, forced, note = self._variant(bits)
            if all(mesh_configs(variant.op_with_batch(op, n), mesh) for op in forced for n in sizes):
                out.append((variant, note))
        return out



def micro_batch_options(batch: int, pp: int, dp: int) -> list[int]:
    """Micro-batch counts to try: pp, 2pp, 4pp, and those giving each data-parallel replica
    1, 2, 4 or 8 sequences per micro-batch (what Megatron runs large models with); m >= pp."""
    wanted = {pp, 2 * pp, 4 * pp} | {batch // (dp * k) for k in (1, 2, 4, 8) if batch % (dp * k) == 0}
    # Every replica's share splits into m equal micro-batches (the pipeline schedules need equal
    # shapes; trainer/mesh.py refuses the rest).
    found = sorted(m for m in wanted if m >= pp and m >= 1 and batch % (m * dp) == 0)
    return found or [m for m in range(pp, 0, -1) if batch % (m * dp) == 0][:1]
