"""The exact dynamic program over configurations (PaSE's DP as min-sum variable elimination).

PaSE orders vertices with GENERATESEQ (repeatedly take the vertex whose dependent set is
smallest) and tabulates, for each vertex, the best cost of everything eliminated so far for every
configuration of its dependent set. Variable elimination is that DP in another dress: to
eliminate vertex v, add every cost table that mentions v, minimise over v's configuration and keep
the result as a table over v's current neighbours — exactly v's dependent set. Tables that share
no vertex never meet, so connected components recombine by addition for free, and the
elimination order may follow a tree decomposition rather than a path (never worse than PaSE's
sequence). The greedy order picks the vertex whose new table is smallest (counting
configurations, not vertices, since ops differ wildly in configuration counts).

Repeated blocks: each block's interior is eliminated on its own, leaving tables over its
boundary; identical blocks (same cost tables, same structure) reuse the first one's result, so
time grows with the number of distinct blocks, not with depth. Everything is exact: the result
is the global minimum of the sum of all tables, as brute force finds (tests check this).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# Largest table (in float64 entries, 8 bytes each) one elimination may build: 2^27 = 1 GiB.
MAX_TABLE = 1 << 27


@dataclass
class Factor:
    """A cost table over `scope` (variable ids), axes in scope order."""

    scope: tuple[int, ...]
    table: np.ndarray
    owner: str | None = None  # the block whose subproblem this table belongs to


@dataclass
class Problem:
    """Minimise the sum of `factors` over one configuration index per variable."""

    card: list[int]
    factors: list[Factor]
    block_of: dict[int, str] = field(default_factory=dict)  # variable -> block instance


Step = tuple[int, tuple[int, ...], np.ndarray]  # (variable, its dependent set, argmin table)


def _combine(factors: list[Factor], scope: tuple[int, ...], card: list[int]) -> np.ndarray:
    """Sum of the factors broadcast over `scope`."""
    shape = tuple(card[v] for v in scope)
    size = int(np.prod(shape, dtype=np.float64))
    if size > MAX_TABLE:
        raise MemoryError(f"a dependent-set table of {size:,} entries (scope {len(scope)} ops) exceeds {MAX_TABLE:,}")
    pos = {v: i for i, v in enumerate(scope)}
    acc = np.zeros(shape)
    for f in factors:
        order = sorted(range(len(f.scope)), key=lambda i: pos[f.scope[i]])
        t = f.table.transpose(order) if order != list(range(len(order))) else f.table
        placed = [1] * len(scope)
        for v in f.scope:
            placed[pos[v]] = card[v]
        acc += t.reshape(placed)
    return acc


def eliminate(factors: list[Factor], variables: set[int], card: list[int]) -> tuple[list[Factor], list[Step]]:
    """Eliminate `variables` greedily (smallest new table first); return remaining factors, steps."""
    live = {i: f for i, f in enumerate(factors)}
    touching: dict[int, set[int]] = {}
    for i, f in live.items():
        for v in f.scope:
            touching.setdefault(v, set()).add(i)
    todo = set(variables)
    steps: list[Step] = []
    next_id = len(factors)

    def width(v: int) -> float:
        scope = {u for i in touching.get(v, ()) for u in live[i].scope}
        return float(np.prod([card[u] for u in scope], dtype=np.float64))

    sizes = {v: width(v) for v in todo}
    while todo:
        v = min(todo, key=lambda u: (sizes[u], u))
        todo.discard(v)
        ids = touching.pop(v, set())
        group = [live.pop(i) for i in sorted(ids)]
        dep = tuple(sorted({u for f in group for u in f.scope} - {v}))
        for u in dep:
            touching[u] -= ids
        if not group:
            steps.append((v, (), np.zeros((), dtype=np.int64)))
            continue
        acc = _combine(group, (*dep, v), card)
        arg = acc.argmin(axis=-1)
        best = np.take_along_axis(acc, arg[..., None], axis=-1)[..., 0]
        steps.append((v, dep, arg))
        live[next_id] = Factor(dep, best)
        for u in dep:
            touching[u].add(next_id)
        next_id += 1
        for u in dep:
            if u in todo:
                sizes[u] = width(u)
    return list(live.values()), steps


def _backsolve(steps: list[Step], assign: dict[int, int], rename: dict[int, int] | None = None) -> None:
    """Fill `assign` from elimination steps, last eliminated first (its dependents are known)."""
    for v, dep, arg in reversed(steps):
        if rename is None:
            assign[v] = int(arg[tuple(assign[u] for u in dep)])
        else:
            assign[rename[v]] = int(arg[tuple(assign[rename[u]] for u in dep)])


def solve(problem: Problem, memoise: bool = True) -> tuple[list[int], float]:
    """The exact minimum of the problem and one configuration index per variable attaining it."""
    card = problem.card
    n = len(card)
    by_block: dict[str, list[Factor]] = {}
    loose: list[Factor] = []
    for f in problem.factors:
        (by_block.setdefault(f.owner, []) if f.owner is not None else loose).append(f)
    referenced_outside: dict[str, set[int]] = {}  # block -> its variables used by other owners' tables
    for f in problem.factors:
        for v in f.scope:
            b = problem.block_of.get(v)
            if b is not None and f.owner != b:
                referenced_outside.setdefault(b, set()).add(v)

    memo: dict[tuple, tuple[list[Factor], list[Step]]] = {}
    block_steps: list[tuple[list[Step], dict[int, int]]] = []
    remaining = list(loose)
    for block, factors in by_block.items():
        variables = sorted({v for f in factors for v in f.scope})
        members = {v for v in variables if problem.block_of.get(v) == block}
        interior = {v for v in members if v not in referenced_outside.get(block, set())}
        local = {v: i for i, v in enumerate(variables)}
        key = (
            tuple(card[v] for v in variables),
            tuple(sorted(local[v] for v in interior)),
            tuple((tuple(local[v] for v in f.scope), id(f.table)) for f in factors),
        )
        if memoise and key in memo:
            res, steps = memo[key]
        else:
            loc_card = [card[v] for v in variables]
            loc_factors = [Factor(tuple(local[v] for v in f.scope), f.table) for f in factors]
            res, steps = eliminate(loc_factors, {local[v] for v in interior}, loc_card)
            memo[key] = (res, steps)
        remaining += [Factor(tuple(variables[i] for i in f.scope), f.table) for f in res]
        block_steps.append((steps, dict(enumerate(variables))))

    eliminated_in_blocks = {rename[v] for steps, rename in block_steps for v, _, _ in steps}
    rest = set(range(n)) - eliminated_in_blocks
    final, steps = eliminate(remaining, rest, card)
    total = float(sum(float(f.table) for f in final))
    assign: dict[int, int] = {}
    _backsolve(steps, assign)
    for bsteps, rename in block_steps:
        _backsolve(bsteps, assign, rename)
    return [assign[v] for v in range(n)], total


def evaluate(problem: Problem, assign: list[int]) -> float:
    """The sum of the tables at one assignment (the objective the search minimises)."""
    return float(sum(f.table[tuple(assign[v] for v in f.scope)] for f in problem.factors))


def brute_force(problem: Problem, max_states: int = 50_000_000) -> tuple[list[int], float]:
    """Every assignment at once: the full joint table, then its argmin. For small problems only."""
    card = problem.card
    states = int(np.prod(card, dtype=np.float64))
    if states > max_states:
        raise ValueError(f"brute force over {states:,} assignments exceeds {max_states:,}")
    full = _combine(problem.factors, tuple(range(len(card))), card) if card else np.zeros(())
    flat = int(np.argmin(full))
    return [int(i) for i in np.unravel_index(flat, full.shape)], float(full.reshape(-1)[flat])
