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

import heapq
from dataclasses import dataclass, field
from functools import lru_cache
from math import prod

import numpy as np

# Largest dependent-set table (float64 entries, 8 bytes each) an elimination may keep: 256 MiB
# (a search's peak stays under 1 GB).
MAX_TABLE = 1 << 25
# Table entries a solve may compute, as simulated over the whole graph (an overestimate where
# identical layers are solved once): PaSE's Transformer is 2.2e9 at p = 64 (~1.7 s here) and
# 8.8e9 at p = 128; past it the problem is narrowed and relaxed (solve_bounded): two solves of
# at most FALLBACK_WORK each.
MAX_WORK = 4e9
# Past MAX_WORK, each of the two bounded solves (relaxed, narrowed) gets at most this much: a
# fully dense 40-op DAG at 8 devices spent 2 x 4e9 entries (49-62 s on a 2-core host) where
# 1e9 each gave the same, proven plan (BENCHMARKS.md "Dense DAGs").
FALLBACK_WORK = 1e9
# Ops brute force can enumerate: its joint table has one array axis per op, and numpy arrays
# have at most 64 (past it numpy fails with "maximum supported dimension", however few states).
BRUTE_FORCE_MAX_OPS = 64
# Graphs up to this many variables also try randomised near-greedy elimination orders.
RANDOM_ORDERS_UP_TO = 2000
# Eliminations whose full table (dependents x own configurations) is larger run in slices of
# the first dependent, so the working set stays in cache and under ~32 MiB.
CHUNK = 1 << 22
INT16_MAX = int(np.iinfo(np.int16).max)


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
# Variable -> the configuration indices it may still take (absent: all of them).
Domains = dict[int, tuple[int, ...]]


# From this many entries on, `_combine` grows its sum variable by variable (below it, the
# bookkeeping costs more than the passes it saves: the DP makes thousands of small tables).
GROWN_FROM = 1 << 15


def _combine(factors: list[Factor], scope: tuple[int, ...], card: list[int]) -> np.ndarray:
    """Sum of the factors broadcast over `scope`, largest first (one fixed order per call)."""
    shape = tuple(card[v] for v in scope)
    size = prod(shape)  # math.prod: exact, and no numpy call per table (the DP makes thousands of small ones)
    if size > MAX_TABLE * 4:
        raise MemoryError(f"a table of {size:,} entries (scope {len(scope)} ops) exceeds {MAX_TABLE * 4:,}")
    if not factors:
        return np.zeros(shape)
    pos = {v: i for i, v in enumerate(scope)}
    largest_first = sorted(factors, key=lambda f: -f.table.size)
    if size >= GROWN_FROM and largest_first[0].table.size < size:  # else every factor's variables are the largest's
        return _grown_sum([_in_scope_order(f, pos) for f in largest_first], scope, card, pos)
    acc = np.empty(shape)
    # Inline, not `_in_scope_order` and `_grown_sum`'s shapes: on the 10,000s of small tables of a
    # long chain, those calls per factor cost its search 3-5% (measured, forty-eighth session).
    for k, f in enumerate(largest_first):
        order = sorted(range(len(f.scope)), key=lambda i: pos[f.scope[i]])
        t = f.table.transpose(order) if order != list(range(len(order))) else f.table
        placed = [1] * len(scope)
        for v in f.scope:
            placed[pos[v]] = card[v]
        # The largest table is written, not added to zeros: one pass fewer over the result.
        if k == 0:
            acc[...] = t.reshape(placed)
        else:
            acc += t.reshape(placed)
    return acc


def _in_scope_order(f: Factor, pos: dict[int, int]) -> tuple[tuple[int, ...], np.ndarray]:
    """The factor's variables and table with its axes in scope order (a view)."""
    order = sorted(range(len(f.scope)), key=lambda i: pos[f.scope[i]])
    if order == list(range(len(order))):
        return f.scope, f.table
    return tuple(f.scope[i] for i in order), f.table.transpose(order)


def _grown_sum(tables: list[tuple[tuple[int, ...], np.ndarray]], scope: tuple[int, ...], card: list[int],
               pos: dict[int, int]) -> np.ndarray:
    """`_combine`'s sum, added into a table over only the variables added so far, which grows
    to `scope` as tables bring new ones. Each entry is the same sum, in the same order, as in a
    table over all of `scope` from the first (bit for bit), but small tables over few variables
    (a dense graph's edge tables: 12 of them into a 4M-entry table) cost a pass over the
    variables they were joined with, not over the whole table: the 40-op dense DAG plans in
    0.7x the time (BENCHMARKS.md, forty-eighth session)."""

    def dims(variables: tuple[int, ...], over: tuple[int, ...]) -> list[int]:
        at = {v: i for i, v in enumerate(over)}
        placed = [1] * len(over)
        for v in variables:
            placed[at[v]] = card[v]
        return placed

    have, acc = tables[0][0], np.array(tables[0][1], order="C")  # the variables the sum spans so far
    for variables, t in tables[1:]:
        if set(variables) <= set(have):
            acc += t.reshape(dims(variables, have))
            continue
        grown = tuple(sorted({*have, *variables}, key=pos.__getitem__))
        joined = np.empty([card[v] for v in grown])
        np.add(acc.reshape(dims(have, grown)), t.reshape(dims(variables, grown)), out=joined)
        have, acc = grown, joined
    if len(have) < len(scope):  # a variable no table names: the sum is the same along it
        acc = np.array(np.broadcast_to(acc.reshape(dims(have, scope)), [card[v] for v in scope]), order="C")
    return acc


def _greedy(nbrs: dict[int, set[int]], variables: set[int], card: list[int], rng: np.random.Generator | None,
            give_up: float) -> tuple[list[int], float]:
    """One greedy elimination order on the interaction graph (smallest table next; with `rng`,
    a random pick among tables within 4x of the smallest). Stops early past `give_up` work.

    The pure greedy order keeps the sizes in a heap (stale entries skipped when popped), so a
    step costs the eliminated vertex's neighbourhood, not a scan of every vertex: near-linear
    on graphs of bounded degree (a 20,000-op chain). An order that would keep a table over
    MAX_TABLE is complete but costs infinite work."""
    nbrs = {v: set(n) for v, n in nbrs.items()}

    def size(v: int) -> int:
        return card[v] * prod(card[u] for u in nbrs[v])

    sizes = {v: size(v) for v in variables}
    heap = [(sizes[v], v) for v in variables]
    heapq.heapify(heap)
    todo, order, work, too_big = set(variables), [], 0.0, False
    while todo:
        if rng is None:
            while True:
                s, v = heapq.heappop(heap)
                if v in todo and s == sizes[v]:
                    break
        else:
            low = min(sizes[u] for u in todo)
            near = sorted(u for u in todo if sizes[u] <= low * 4)
            v = near[int(rng.integers(len(near)))]
        work += sizes[v]
        if work >= give_up:
            return order, float("inf")
        too_big = too_big or sizes[v] // card[v] > MAX_TABLE  # a table `eliminate` would refuse
        order.append(v)
        todo.discard(v)
        for u in nbrs[v]:
            nbrs[u] |= nbrs[v]
            nbrs[u].discard(u)
            nbrs[u].discard(v)
        for u in nbrs[v]:
            if u in todo:
                sizes[u] = size(u)
                if rng is None:
                    heapq.heappush(heap, (sizes[u], u))
    return order, float("inf") if too_big else work


# Elimination problems of at most this many tables have their orders kept (`_order_of`), the
# last ORDERS_KEPT of them: a layer's block or a stage's remainder, a few hundred shapes per
# search. Larger ones are planned each time: their keys alone would hold megabytes each.
ORDER_KEPT_UP_TO = 512
ORDERS_KEPT = 1024


@lru_cache(maxsize=ORDERS_KEPT)
def _kept_order(scopes: tuple[tuple[int, ...], ...], variables: tuple[int, ...],
                card: tuple[int, ...]) -> tuple[tuple[int, ...], float]:
    order, work = plan_order(list(scopes), set(variables), list(card))
    return tuple(order), work


def _order_of(factors: list[Factor], variables: set[int], card: list[int]) -> tuple[list[int] | tuple[int, ...], float]:
    """`plan_order`, kept per shape where small: an order depends on the tables' scopes and
    sizes, not on their values, and a constrained search solves the same shapes at many
    multipliers."""
    if len(factors) > ORDER_KEPT_UP_TO:
        return plan_order([f.scope for f in factors], variables, card)
    return _kept_order(tuple(f.scope for f in factors), tuple(sorted(variables)), tuple(card))


def plan_order(scopes: list[tuple[int, ...]], variables: set[int], card: list[int],
               tries: int = 8) -> tuple[list[int], float]:
    """A cheap elimination order: simulate greedy orders on scopes alone, keep the least work.

    Work is the sum of the tables' sizes, which is what elimination then spends. Pure greedy
    first; when that is expensive (over 1M entries), a few randomised near-greedy orders too.
    """
    nbrs: dict[int, set[int]] = {}
    for sc in scopes:
        for v in sc:
            nbrs.setdefault(v, set()).update(sc)
    for v in variables:
        nbrs.setdefault(v, set()).discard(v)
    for v, n in nbrs.items():
        n.discard(v)
    best, work = _greedy(nbrs, variables, card, None, float("inf"))
    # Randomised orders scan every vertex per step: tried only where that stays cheap.
    if work > 1e6 and 2 < len(variables) <= RANDOM_ORDERS_UP_TO:
        rng = np.random.default_rng(0)
        for _ in range(tries - 1):
            order, w = _greedy(nbrs, variables, card, rng, work)
            if w < work:
                best, work = order, w
    return best, work


def eliminate(factors: list[Factor], variables: set[int], card: list[int]) -> tuple[list[Factor], list[Step]]:
    """Eliminate `variables` in `plan_order`; return the remaining factors and the steps."""
    live = {i: f for i, f in enumerate(factors)}
    touching: dict[int, set[int]] = {}
    for i, f in live.items():
        for v in f.scope:
            touching.setdefault(v, set()).add(i)
    steps: list[Step] = []
    next_id = len(factors)
    order, _ = _order_of(factors, variables, card)
    for v in order:
        ids = touching.pop(v, set())
        group = [live.pop(i) for i in sorted(ids)]
        dep = tuple(sorted({u for f in group for u in f.scope} - {v}))
        for u in dep:
            touching[u] -= ids
        if not group:
            steps.append((v, (), np.zeros((), dtype=np.int64)))
            continue
        best, arg = _min_over(group, dep, v, card)
        steps.append((v, dep, arg))
        live[next_id] = Factor(dep, best)
        for u in dep:
            touching[u].add(next_id)
        next_id += 1
    return list(live.values()), steps


def _fix(f: Factor, u: int, i: int) -> Factor:
    """The factor with variable u fixed to configuration i."""
    if u not in f.scope:
        return f
    k = f.scope.index(u)
    return Factor(f.scope[:k] + f.scope[k + 1:], f.table[(slice(None),) * k + (i,)])  # a view, no copy


# numpy reduces a short last axis one outer index at a time; over a large table, the same
# minimum taken as element-wise minima of the axis' slices (each a vectorised pass over the
# whole table) is 2-15x faster here for the 4-16 configurations an op has, from ~512 outer
# entries on (min is exact: the same bits either way).
SHORT_AXIS = 16
SLICED_MIN_FROM = 512


def _min_last(table: np.ndarray) -> np.ndarray:
    """The minimum over the table's last axis."""
    k = table.shape[-1]
    if table.ndim < 2 or k > SHORT_AXIS or table.size < SLICED_MIN_FROM * k:
        return table.min(axis=-1)
    if k == 1:
        return table[..., 0].copy()
    least = np.minimum(table[..., 0], table[..., 1])  # no copy of the first slice first: one strided pass fewer
    for j in range(2, k):
        np.minimum(least, table[..., j], out=least)
    return least


def _min_over(group: list[Factor], dep: tuple[int, ...], v: int, card: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """min and argmin over v of the sum of `group`, as tables over `dep` (sliced when large)."""
    full = prod(card[u] for u in (*dep, v))
    if full <= CHUNK or not dep:
        acc = _combine(group, (*dep, v), card)
        arg = acc.argmin(axis=-1)
        # Kept until the back-substitution, one per eliminated op: the smallest integers that hold
        # a configuration index (a 5,000-op graph keeps thousands of these tables).
        kept = arg.astype(np.int16 if card[v] <= INT16_MAX else np.int32)
        # The minimum is the entry argmin points at, bit for bit: min() reads it without building
        # an index array per table (take_along_axis's overhead dominated small tables).
        return _min_last(acc), kept
    if full / card[v] > MAX_TABLE:
        raise MemoryError(f"a dependent-set table of {full / card[v]:,.0f} entries exceeds {MAX_TABLE:,}")
    u = dep[0]
    parts = [_min_over([_fix(f, u, i) for f in group], dep[1:], v, card) for i in range(card[u])]
    return np.stack([b for b, _ in parts]), np.stack([a for _, a in parts])


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


def restrict(problem: Problem, domains: Domains) -> Problem:
    """The problem over the configurations `domains` allows (index i of variable v stands for
    `domains[v][i]`). Tables touching no restricted variable are kept as they are, and a table
    shared by several factors is sliced once per distinct restriction, so identical blocks are
    still recognised (`solve` memoises them by table identity)."""
    if not domains:
        return problem
    card = [len(domains[v]) if v in domains else c for v, c in enumerate(problem.card)]
    factors = []
    sliced: dict[tuple, np.ndarray] = {}
    for f in problem.factors:
        if not any(v in domains for v in f.scope):
            factors.append(f)
            continue
        axes = tuple(domains.get(v) for v in f.scope)
        key = (id(f.table), axes)
        if key not in sliced:
            index = np.ix_(*[np.asarray(a) if a is not None else np.arange(n) for a, n in zip(axes, f.table.shape, strict=True)])
            sliced[key] = f.table[index]
        factors.append(Factor(f.scope, sliced[key], f.owner))
    return Problem(card, factors, problem.block_of)


def unrestrict(assign: list[int], domains: Domains) -> list[int]:
    return [domains[v][i] if v in domains else i for v, i in enumerate(assign)]


def evaluate(problem: Problem, assign: list[int]) -> float:
    """The sum of the tables at one assignment (the objective the search minimises)."""
    return float(sum(f.table[tuple(assign[v] for v in f.scope)] for f in problem.factors))


def _check_brute_force(card: list[int], max_states: int) -> None:
    """ValueError when the joint table would have too many axes or entries to build."""
    if len(card) > BRUTE_FORCE_MAX_OPS:
        raise ValueError(f"brute force enumerates at most {BRUTE_FORCE_MAX_OPS} ops (one array axis each), "
                         f"this has {len(card)}")
    states = int(np.prod(card, dtype=np.float64))
    if states > max_states:
        raise ValueError(f"brute force over {states:,} assignments exceeds {max_states:,}")


def brute_force(problem: Problem, max_states: int = 50_000_000) -> tuple[list[int], float]:
    """Every assignment at once: the full joint table, then its argmin. For small problems only."""
    card = problem.card
    _check_brute_force(card, max_states)
    full = _combine(problem.factors, tuple(range(len(card))), card) if card else np.zeros(())
    flat = int(np.argmin(full))
    return [int(i) for i in np.unravel_index(flat, full.shape)], float(full.reshape(-1)[flat])


def brute_force_constrained(problem: Problem, memory: Problem, limit: float,
                            max_states: int = 50_000_000) -> tuple[list[int], float] | None:
    """The minimum of `problem` over every assignment whose `memory` (the sum of its tables)
    is at most `limit`, by enumerating them all; None when none fits. For small problems only:
    what the constrained search is tested against."""
    card = problem.card
    _check_brute_force(card, max_states)
    scope = tuple(range(len(card)))
    objective = _combine(problem.factors, scope, card) if card else np.zeros(())
    used = _combine(memory.factors, scope, card) if card else np.zeros(())
    objective = np.where(used <= limit, objective, np.inf)
    flat = int(np.argmin(objective))
    if not np.isfinite(objective.reshape(-1)[flat]):
        return None
    return [int(i) for i in np.unravel_index(flat, objective.shape)], float(objective.reshape(-1)[flat])


@dataclass
class Solved:
    """An assignment, its value on the whole problem, and a lower bound on the problem's
    minimum: equal when the DP ran on the whole problem; lower when it had to leave out
    pairwise tables (`dropped`) to stay within MAX_WORK and MAX_TABLE."""

    assign: list[int]
    value: float
    lower: float
    dropped: int = 0


def solve_bounded(problem: Problem) -> Solved:
    """`solve`, bounded on any graph. Where the elimination would compute more than MAX_WORK
    table entries or keep a table over MAX_TABLE, two solves within those limits replace it:
    a relaxation (`_relaxed`: pairwise tables of finite costs, never the tie constraints, left
    out longest-reaching first) whose minimum is a lower bound, since every cost is
    non-negative; and the problem narrowed to each op's cheapest configurations (`_narrowed`).
    The better of their assignments, valued on the whole problem, is the answer."""
    if predicted_work(problem) <= MAX_WORK:
        try:
            assign, total = solve(problem)
            return Solved(assign, total, total)
        except MemoryError:
            pass
    lower, dropped, relaxed_assign = _relaxed(problem)
    best = Solved(relaxed_assign, evaluate(problem, relaxed_assign), lower, dropped)
    if best.value <= lower * (1 + 1e-12):  # the relaxation's answer meets its bound: proven, nothing to narrow
        return best
    narrowed = _narrowed(problem)
    if narrowed is not None and narrowed[1] < best.value:
        best.assign, best.value = narrowed
    return best


def _fallback_work() -> float:
    """The work each bounded solve may do (never more than MAX_WORK)."""
    return min(MAX_WORK, FALLBACK_WORK)


def _relaxed(problem: Problem) -> tuple[float, int, list[int]]:
    """The minimum and an assignment of the problem without its longest-reaching finite
    pairwise tables (as few left out as keep the work within MAX_WORK), and how many."""
    span = {id(f): abs(f.scope[0] - f.scope[1]) for f in problem.factors
            if len(f.scope) == 2 and bool(np.isfinite(f.table).all())}
    for reach in sorted(set(span.values()), reverse=True):
        relaxed = Problem(problem.card, [f for f in problem.factors if span.get(id(f), 0) < reach], problem.block_of)
        if predicted_work(relaxed) > _fallback_work():
            continue
        try:
            assign, lower = solve(relaxed)
        except MemoryError:
            continue
        return lower, len(problem.factors) - len(relaxed.factors), assign
    raise MemoryError("no relaxation of the problem fits: a single op's tables exceed the limit")


def _narrowed(problem: Problem) -> tuple[list[int], float] | None:
    """The exact minimum over each op's k cheapest configurations (by its own table), k as large
    as the work allows: a consistent assignment, often the optimum (None: none keeps the ties)."""
    own: list[np.ndarray] = [np.zeros(c) for c in problem.card]
    for f in problem.factors:
        if len(f.scope) == 1:
            own[f.scope[0]] = own[f.scope[0]] + f.table
    ranked = [tuple(int(i) for i in np.argsort(t, kind="stable")) for t in own]

    def domains(k: int) -> Domains:
        return {v: r[:k] for v, r in enumerate(ranked) if len(r) > k}

    lo, hi = 1, max(problem.card)  # the largest k whose work fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        shape = Problem([min(c, mid) for c in problem.card], problem.factors)  # work reads cards and scopes only
        if predicted_work(shape) <= _fallback_work():
            lo = mid
        else:
            hi = mid - 1
    chosen = domains(lo)
    try:
        assign, total = solve(restrict(problem, chosen))
    except MemoryError:
        return None
    if not np.isfinite(total):
        return None
    full = unrestrict(assign, chosen)
    return full, evaluate(problem, full)


_WORK: dict[tuple, float] = {}


def predicted_work(problem: Problem) -> float:
    """Table entries the elimination of the whole problem would compute (its order simulated on
    scopes alone; kept per structure, since a search solves the same one for many costs)."""
    key = (tuple(problem.card), tuple(f.scope for f in problem.factors))
    if key not in _WORK:
        if len(_WORK) > 256:
            _WORK.clear()
        _WORK[key] = plan_order([f.scope for f in problem.factors], set(range(len(problem.card))), problem.card)[1]
    return _WORK[key]
