"""A fitting assignment near the fast one: the Lagrangian search's primal heuristic.

At the best multiplier the DP returns two solutions, a fast one over the memory limit and a
fitting one, and the constrained optimum often lies between them: many ops that could each take
either configuration, of which only some must give up the fast one to fit (identical layers of
a chain: the multiplier makes every op indifferent at once, so the DP's solutions switch them
all or none). Branching on one op at a time closes such a gap slowly. This walks from the fast
solution toward the fitting one, one op at a time, always taking the switch that costs the least
time per byte saved (edges and tie tables re-read against the neighbours' current choice, so a
switch that breaks a tie is never taken), until the assignment fits. Its answer is only an
incumbent: the search's bound, not this, decides what is proven.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

import numpy as np
from parashift.planner.dp import Problem


def repair(problem: Problem, memory: Sequence[np.ndarray], fast: Sequence[int], fitting: Sequence[int],
           limit: float) -> list[int] | None:
    """Switch ops of `fast` to their configuration in `fitting`, cheapest time per byte saved
    first, until the memory (a sum of per-op `memory` arrays) is within `limit`; None if it
    never is. `problem` holds time only (unary and pairwise tables, ties as inf)."""
    assign = list(fast)
    used = sum(float(memory[v][c]) for v, c in enumerate(assign))
    if used <= limit:
        return assign
    unary: dict[int, np.ndarray] = {}
    pairs: dict[int, list[tuple[tuple[int, ...], np.ndarray]]] = {}
    for f in problem.factors:
        if len(f.scope) == 1:
            v = f.scope[0]
            unary[v] = unary[v] + f.table if v in unary else f.table
        else:
            for v in f.scope:
                pairs.setdefault(v, []).append((f.scope, f.table))

    def local(v: int, c: int) -> float:
        """Time of v's terms with v at c and every other op at its current choice."""
        total = float(unary[v][c]) if v in unary else 0.0
        for scope, table in pairs.get(v, ()):
            total += float(table[tuple(c if u == v else assign[u] for u in scope)])
        return total

    def price(v: int) -> float:
        """Seconds added per byte saved by switching v to its fitting configuration."""
        saved = float(memory[v][assign[v]] - memory[v][fitting[v]])
        if saved <= 0.0:
            return math.inf
        extra = local(v, fitting[v]) - local(v, assign[v])
        return extra / saved if math.isfinite(extra) else math.inf

    heap = [(price(v), v) for v in range(len(assign)) if assign[v] != fitting[v]]
    heap = [entry for entry in heap if math.isfinite(entry[0])]
    heapq.heapify(heap)
    while heap and used > limit:
        stale, v = heapq.heappop(heap)
        if assign[v] == fitting[v]:
            continue
        now = price(v)
        if not math.isfinite(now):
            continue  # a neighbour's switch made this one break a tie; it may return if theirs do
        if now > stale + 1e-12 * max(1.0, abs(stale)):
            heapq.heappush(heap, (now, v))  # its neighbours moved: re-queue at its true price
            continue
        used -= float(memory[v][assign[v]] - memory[v][fitting[v]])
        assign[v] = fitting[v]
        for scope, _ in pairs.get(v, ()):
            for u in scope:
                if u != v and assign[u] != fitting[u]:
                    p = price(u)
                    if math.isfinite(p):
                        heapq.heappush(heap, (p, u))
    return assign if used <= limit else None
