"""The fastest assignment whose memory fits a limit, exactly: branch and bound on the Lagrangian.

A stage's time is a sum of unary and pairwise tables and its memory a sum of unary ones, so for
a multiplier lam >= 0 the DP (dp.py) finds min T + lam M exactly. That minimum minus lam L is a
lower bound on the time of every assignment with M <= L (weak duality), for any lam. The best
lam is found exactly by intersecting the lines of a fitting and a non-fitting solution until
the DP finds nothing below the intersection (cutting planes on a concave, piecewise-linear
function of one variable; each step adds a vertex of the convex hull of (M, T), so it ends).

When the fastest fitting solution met is slower than that bound, the constrained optimum lies
inside the hull (a duality gap) and a Lagrangian search alone can miss it. Then the search
branches on an op whose configuration differs between the two solutions around the best lam:
one child fixes it to the non-fitting solution's configuration, the other removes that
configuration. Children are solved on restricted problems (tables sliced to their domains),
best bound first, and dropped once their bound cannot beat the fastest fitting assignment met.
Run to the end the answer is the constrained optimum of the cost model; stopped by the node
budget, it is the fastest assignment met with a proven lower bound on the optimum.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import numpy as np
from parashift.planner.dp import Domains

# Relative slack for comparing sums taken in different orders.
EPS = 1e-9
# Restricted sub-problems a search may open, and DP solves it may run, before it settles for a
# bound (counts, not seconds: the same input always gives the same plan).
MAX_NODES = 256
MAX_SOLVES = 1024
# Cutting-plane steps per node; each finds a new hull vertex, so this is never reached on
# problems of sane size and only guards against floating-point cycling.
MAX_CUTS = 64


class Solution(Protocol):
    assign: list[int]

    @property
    def time_s(self) -> float: ...

    @property
    def memory_bytes(self) -> float: ...


S = TypeVar("S", bound=Solution)


@dataclass
class Outcome(Generic[S]):
    """The fastest fitting solution met (None: nothing fits), a lower bound on the time of every
    fitting assignment, and whether the solution is proven to reach it."""

    best: S | None
    bound: float
    proven: bool
    nodes: int
    met: list[S]


def _slack(s: Solution) -> float:
    """How far below `s`'s objective the solver's minimum may lie (a relaxed DP; 0: exact)."""
    return float(getattr(s, "relaxation_s", 0.0))


@dataclass
class _Node(Generic[S]):
    bound: float
    domains: Domains
    fast: S | None = None  # the non-fitting solution at the best lam (None: the node is solved)
    fitting: S | None = None  # the fitting one


class LagrangianSearch(Generic[S]):
    """min time s.t. memory <= `limit`, given `solve(lam, domains)` (the exact minimum of
    T + lam M over the assignments within `domains`, None when none keeps every tie),
    `least(domains)` (the least-memory one) and each variable's memory per configuration."""

    def __init__(self, solve: Callable[[float, Domains], S | None], least: Callable[[Domains], S | None],
                 memory: list[np.ndarray], limit: float, max_nodes: int = MAX_NODES, max_solves: int = MAX_SOLVES,
                 cutoff: float = math.inf, repair: Callable[[S, S], S | None] | None = None) -> None:
        """`cutoff`: a time past which nothing matters to the caller (a faster strategy is
        known): the search stops once every open node's bound reaches it. `repair(fast,
        fitting)`: a fitting solution built between the root's two solutions at the best
        multiplier (planner/repair.py), an incumbent to prune by."""
        self.solve, self.least, self.memory, self.limit, self.repair = solve, least, memory, limit, repair
        self.max_nodes, self.max_solves, self.cutoff = max_nodes, max_solves, cutoff
        self.best: S | None = None
        self.met: list[S] = []
        self.solves = 0

    def _out_of_budget(self) -> bool:
        return self.solves >= self.max_solves

    def _met(self, s: S | None, solved: bool = True) -> S | None:
        self.solves += solved
        if s is not None:
            self.met.append(s)
            if s.memory_bytes <= self.limit and (self.best is None or s.time_s < self.best.time_s):
                self.best = s
        return s

    def _node(self, domains: Domains, inherited: float = -math.inf) -> _Node[S] | None:
        """The node's Lagrangian bound (None: nothing within it fits). The root's best
        multiplier is always found (a few solves: the bound every answer is judged by); the
        budget stops only the nodes below it. `inherited`: the parent's bound, valid for every
        assignment within the child too (a child stopped early keeps it)."""
        limit = self.limit
        fast = self._met(self.solve(0.0, domains))
        if fast is None:
            return None
        if fast.memory_bytes <= limit:  # its fastest fits: solved (exactly, unless relaxed)
            return _Node(max(inherited, fast.time_s - _slack(fast)), domains)
        fitting = self._met(self.least(domains))
        if fitting is None or fitting.memory_bytes > limit:
            return None
        bound = max(inherited, fast.time_s - _slack(fast))  # g(0)
        for _ in range(MAX_CUTS):
            if bound >= self.cutoff or (domains and self._out_of_budget()):
                break  # the bound so far is valid; the caller does not need a better one
            lam = max(0.0, (fitting.time_s - fast.time_s) / (fast.memory_bytes - fitting.memory_bytes))
            line = fast.time_s + lam * (fast.memory_bytes - limit)
            s = self._met(self.solve(lam, domains))
            assert s is not None  # `fast` is within the domains
            reached = s.time_s + lam * (s.memory_bytes - limit)
            bound = max(bound, reached - _slack(s))  # g(lam), a lower bound for any lam
            if reached >= line - EPS * max(abs(line), 1e-300):
                break  # nothing below the two lines' crossing: lam maximises g
            if s.memory_bytes <= limit:
                fitting = s
            else:
                fast = s
        if self.repair is not None and not domains:
            self._met(self.repair(fast, fitting), solved=False)
        return _Node(bound, domains, fast, fitting)

    def _branch(self, node: _Node[S]) -> list[Domains]:
        """Two children that split the node's assignments: the op whose two solutions differ
        most in memory, fixed to the fast one's configuration, or with it removed."""
        assert node.fast is not None and node.fitting is not None
        fast, fitting = node.fast.assign, node.fitting.assign
        differ = [v for v, (a, b) in enumerate(zip(fast, fitting, strict=True)) if a != b]
        v = max(differ, key=lambda u: (abs(float(self.memory[u][fast[u]] - self.memory[u][fitting[u]])), -u))
        allowed = node.domains.get(v, tuple(range(len(self.memory[v]))))
        rest = tuple(i for i in allowed if i != fast[v])
        return [{**node.domains, v: (fast[v],)}, {**node.domains, v: rest}]

    def run(self) -> Outcome[S]:
        root = self._node({})
        if root is None:
            return Outcome(self.best, math.inf, True, 1, self.met)
        heap: list[tuple[float, int, _Node[S]]] = [(root.bound, 0, root)]
        opened, counter = 1, 1
        while heap:
            bound, _, node = heap[0]
            if self.best is not None and bound >= self.best.time_s * (1 - EPS):
                break  # nothing left can beat the fastest fitting solution met
            if bound >= self.cutoff or node.fast is None or opened >= self.max_nodes or self._out_of_budget():
                break  # past the cutoff, solved exactly (best first: nothing better remains), or out of budget
            heapq.heappop(heap)
            for domains in self._branch(node):
                opened += 1
                child = self._node(domains, node.bound)
                if child is not None and (self.best is None or child.bound < self.best.time_s * (1 - EPS)):
                    heapq.heappush(heap, (child.bound, counter, child))
                    counter += 1
        lowest = min((b for b, _, _ in heap), default=math.inf)
        best_time = self.best.time_s if self.best is not None else math.inf
        proven = lowest >= best_time * (1 - EPS)
        return Outcome(self.best, min(lowest, best_time), proven, opened, self.met)


__all__ = ["LagrangianSearch", "Outcome"]
