"""The planner's entry points: search meshes, stages and per-op configurations; emit a Plan.

Outer loop: one enumeration (outer.py) of every mesh pp x dp x tp = p (within max_tp / max_pp),
pipeline micro-batch counts and stage splits (pipeline.py), visited by an exact branch and bound
that skips candidates whose lower bound exceeds the fastest fitting one. Inner: the exact per-op DP (dp.py) on each stage's graph. Memory is a hard
limit: a branch and bound on the Lagrangian (planner/constrained.py) finds each stage's fastest
fitting assignment, proven optimal under the cost model or, when its node budget runs out, with
a lower bound; the Plan says which (`proven_optimal`, `lower_bound_s`).

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

from parashift.planner import dp
from parashift.planner.baselines import baseline_assign, baseline_meshes
from parashift.planner.checkpointing import checkpointed, with_precision
from parashift.planner.configs import counts_mesh, dtensor_placements
from parashift.planner.costs import CostModel
from parashift.planner.execution import executable
from parashift.planner.graph import Graph
from parashift.planner.outer import branch_and_bound, enumerate_specs, evaluate_all
from parashift.planner.pipeline import step_time
from parashift.planner.problem import UNPIPELINED, tie_factors
from parashift.planner.profile import ModelProfile, profile_graph
from parashift.planner.stage import (
    Candidate,
    Method,
    StageResult,
    solve_stage,
    stage_result,
)
from parashift.specs.plan import OpPlacement, Plan
from parashift.specs.words import gib


def _as_profile(source: ModelProfile | Graph, device_kind: str, devices_per_node: int | None) -> ModelProfile:
    if isinstance(source, ModelProfile):
        if devices_per_node is not None:
            source = source.model_copy(update={"comm": source.comm.model_copy(update={"devices_per_node": devices_per_node})})
        return source
    return profile_graph(source, device_kind, devices_per_node=devices_per_node)


def baselines(profile: ModelProfile, devices: int, max_tp: int | None,
              shard_dp: bool = True) -> dict[str, Candidate | None]:
    """Data parallel, Megatron and (`shard_dp`) FSDP on the same cost model (None: a split does
    not divide), on the meshes the profile prices (`ModelProfile.data_axis`)."""
    g = profile.graph
    out: dict[str, Candidate | None] = {}
    for name, mesh in baseline_meshes(g, devices, profile.comm.devices_per_node, max_tp).items():
        if mesh.shard_dp and not shard_dp:
            continue
        if profile.data_axis is not None and ("dp" in mesh.names) != profile.data_axis:
            continue
        costs = CostModel(g, profile.device, profile.comm, mesh)
        assign = baseline_assign(g, costs)
        if assign is None:
            out[name] = None
            continue
        ties = tie_factors(g, costs)
        if ties and not math.isfinite(dp.evaluate(dp.Problem([], ties), assign)):
            out[name] = None  # it breaks a tie group: a layout the trainer refuses is no candidate
            continue
        res = stage_result(g, costs, assign, UNPIPELINED, 0.0)
        tp = dict(zip(mesh.names, mesh.sizes, strict=True)).get("tp", 1)
        out[name] = Candidate(name, 1, devices // tp, tp, 1, [res], res.time_s, res.memory_bytes)
    return out


# Branch and bound over the outer loop (planner/outer.py); False: every candidate evaluated
# (the reference the tests compare the pruned search with).
PRUNE = True


def candidates(profile: ModelProfile, devices: int, limit: float | None, max_tp: int | None,
               max_pp: int | None, method: Method, incumbent: float = float("inf"),
               prune: bool | None = None, skip_unfit: bool = True) -> list[Candidate]:
    """The candidates of the one enumeration (`outer.enumerate_specs`: meshes, micro-batch
    counts, stage splits), each with its stages solved.

    Pruned (`prune`, default `PRUNE`): only the candidates that may be the fastest fitting one,
    given a fitting strategy of time `incumbent` (see planner/outer.py); the fastest fitting
    candidate, and the first among equals, is the same either way.
    """
    specs = enumerate_specs(profile, devices, limit, max_tp, max_pp, method, skip_unfit)
    if PRUNE if prune is None else prune:
        return branch_and_bound(specs, limit, incumbent)
    return evaluate_all(specs, limit)


def to_plan(best: Candidate, devices: int, base: dict[str, Candidate | None], limit: float | None,
            graph: Graph, searched: list[Candidate] | None = None) -> Plan:
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
            notes.append(f"{name} baseline needs {gib(cand.memory_bytes)} per device, over the limit")
    feasible = best.fits(limit)
    if not feasible:
        notes.append(f"no strategy fits {gib(limit)} per device")
    proven, lower = optimality(best, searched, limit) if feasible and searched is not None else (None, None)
    if best.stage_ac:  # outside the searched space (one mode per candidate): its optimality is not claimed
        proven, lower = None, None
    if proven is False and lower is not None:
        notes.append(f"not proven optimal (a stage's search stopped at its budget, or its DP ran relaxed on a "
                     f"graph too wide to solve whole); every fitting plan takes "
                     f">= {lower:.6g} s per step (at most {(1 - lower / best.time_s) * 100:.2f}% faster than this one)")
    mesh = {axis: n for axis, n in (("pp", best.pp), ("dp", best.dp), ("tp", best.tp)) if n > 1} or {"dp": 1}
    sharded = bool(best.stages) and best.stages[0].mesh.shard_dp
    return executable(Plan(
        devices=devices, mesh=mesh, dp_shard=best.dp if sharded else 1, placements=placements,
        reshard_after_forward=not sharded or best.stages[0].weights.reshard_after_forward,
        micro_batches=best.micro_batches, activation_checkpointing=best.activation_checkpointing,
        stage_activation_checkpointing=best.stage_ac,
        estimated_step_s=best.time_s, memory_per_device_bytes=int(best.memory_bytes), strategy=best.name,
        baselines={k: c.time_s for k, c in base.items() if c is not None},
        baseline_memory_bytes={k: int(c.memory_bytes) for k, c in base.items() if c is not None},
        stages=stages if len(stages) > 1 else [], feasible=feasible, notes=notes,
        proven_optimal=proven, lower_bound_s=lower,
    ), graph)


def per_stage_ac(profile: ModelProfile, best: Candidate, ac_modes: tuple[str, ...], limit: float | None) -> Candidate:
    """A pipeline whose stages each take the fastest checkpointing that fits, keeping the
    search's per-op layout: under 1F1B stage s holds min(m, pp - s) micro-batches' activations
    (the search charges every stage the first's, a bound), so a limit that only the first
    stages strain needs checkpointing there alone. `best` itself where no stage gains (or
    nothing is pipelined); the search's uniform choice is one of the combinations tried, and
    each stage's memory here is at most what the search charged, so the result is never slower
    and still fits."""
    if best.pp == 1 or len(ac_modes) < 2 or not best.stages:
        return best
    first = best.stages[0].graph
    size = first.ops[0].dims[first.batch_dim]
    wholes: dict[str, Graph] = {}
    for mode in ac_modes:
        whole = checkpointed(profile.graph, mode)
        wholes[mode] = whole.model_copy(update={"ops": [whole.op_with_batch(op, size) for op in whole.ops]})
    stages, modes = [], []
    for s, st in enumerate(best.stages):
        names = [op.name for op in st.graph.ops]
        weights = st.weights.of_stage(s, best.pp, best.micro_batches)  # 1F1B: the later stages hold fewer
        options = []
        for mode in ac_modes:
            sub = wholes[mode].subgraph(names)  # its own layers: a stage recomputes one of them at a time
            costs = CostModel(sub, profile.device, profile.comm, st.mesh)
            options.append((mode, stage_result(sub, costs, st.assign, weights, 0.0)))
        fitting = [o for o in options if limit is None or o[1].memory_bytes <= limit]
        mode, result = min(fitting, key=lambda o: o[1].time_s) if fitting else (best.activation_checkpointing, st)
        stages.append(result)
        modes.append(mode)
    time_s = step_time(stages, best.micro_batches, best.boundary_s, profile.device.core_share)
    if len(set(modes)) == 1 or time_s >= best.time_s * (1 - 1e-9):
        return best
    note = ("activation checkpointing chosen per pipeline stage after the search, with its per-op layout kept: "
            + ", ".join(f"stage {s} {mode}" for s, mode in enumerate(modes)))
    return Candidate(best.name, best.pp, best.dp, best.tp, best.micro_batches, stages, time_s,
                     max(r.memory_bytes for r in stages), [*best.notes, note], proven=False, bound_s=None,
                     activation_checkpointing=modes[0], boundary_s=best.boundary_s, stage_ac=modes)


def optimality(best: Candidate, searched: list[Candidate], limit: float | None) -> tuple[bool, float]:
    """Whether `best` is proven the fastest fitting plan, and a lower bound on every fitting
    plan's step time. Candidates the outer search left out were pruned on valid lower bounds;
    each one it returned is either proven optimal for its mesh and split or carries a bound."""
    lower = min([best.time_s] + [c.lower_bound_s() for c in searched if c.fits(limit)])
    return lower >= best.time_s * (1 - 1e-9), lower


def plan_model(source: ModelProfile | Graph, devices: int, memory_limit_bytes: int | None = None,
               max_tp: int | None = None, max_pp: int | None = None, *, device_kind: str = "cuda",
               devices_per_node: int | None = None, method: Method = "dp", shard_dp: bool = True,
               ac_modes: tuple[str, ...] = ("none",), mixed_precision: str | None = None) -> Plan:
    """The fastest strategy under the cost model that fits the memory limit, as a Plan.

    `memory_limit_bytes` None: the profile's device memory (unlimited if unknown). Baselines are
    evaluated on the same cost model; a fitting baseline that is faster than every searched
    candidate would be chosen, which cannot happen since both lie in the searched space.
    `shard_dp`: the dp axis may also shard parameter state (FSDP): two more spaces (resharding
    after forward or not), each searched with the best fitting time so far as its incumbent;
    among equals the earlier space (replicated first) wins.
    `ac_modes`: the activation checkpointing searched, each a space of its own (planner/
    checkpointing.py; among equals the earlier mode wins, and recomputation only adds time, so
    checkpointing is chosen only where the limit needs it or it lets a faster layout fit).
    `mixed_precision`: how bf16 compute is had ("autocast" or "fsdp"; `precision_spaces`); None:
    the graph as built.
    """
    profile = _as_profile(source, device_kind, devices_per_node)
    priced = precision_spaces(profile, mixed_precision)
    limit = memory_limit_bytes if memory_limit_bytes is not None else profile.device.memory_bytes
    base = priced_baselines(priced, ac_modes[0], devices, max_tp, shard_dp)
    for c in base.values():
        if c is not None:
            c.activation_checkpointing = ac_modes[0]
    known = min((c.time_s for c in base.values() if c is not None and c.fits(limit)), default=float("inf"))
    pool: list[Candidate] = []
    for space in spaces(priced, shard_dp, ac_modes):
        found = candidates(space, devices, limit, max_tp, max_pp, method, known)
        for c in found:
            c.activation_checkpointing = space.activation_checkpointing
        known = min([known] + [c.time_s for c in found if c.fits(limit)])
        pool += found
    pool += [c for c in base.values() if c is not None]
    fitting = [c for c in pool if c.fits(limit)]
    if fitting:
        best = min(fitting, key=lambda c: c.time_s)
        best = per_stage_ac(pricing_of(priced, best.dp), best, ac_modes, limit)
        return to_plan(best, devices, base, limit, priced[0].graph, pool)
    # Nothing fits: say so, and return the layout closest to fitting (least memory, then time),
    # with the memory it needs (feasible=False). Searched with the limit, every stage that cannot
    # fit is its least-memory assignment; the bound on weights skips no mesh here.
    g = profile.graph
    floor = g.n_params * g.param_state_bytes / devices
    pool = []
    for space in spaces(priced, shard_dp, ac_modes):
        found = candidates(space, devices, limit, max_tp, max_pp, method, prune=False, skip_unfit=False)
        for c in found:
            c.activation_checkpointing = space.activation_checkpointing
        pool += found
    pool += [c for c in base.values() if c is not None]
    best = closest_to_fitting(pool)
    best.notes.append(f"nothing fits {gib(limit)} per device: this is the layout closest to fitting, "
                      f"needing {gib(best.memory_bytes)} per device (weights and optimizer state alone "
                      f"need >= {gib(floor)} even split {devices} ways)")
    return to_plan(best, devices, base, limit, priced[0].graph)


def precision_spaces(profile: ModelProfile, mixed_precision: str | None) -> list[ModelProfile]:
    """The profiles meshes are priced on: the graph under `mixed_precision` (None: as built).
    FSDP2's policy ("fsdp") holds only where a plan has a data axis; the trainer computes under
    autocast elsewhere (`checkpointing.policy_on`), so under "fsdp" meshes without one are
    priced under autocast, as they run: a plan never fits on paper only."""
    if mixed_precision is None:
        return [profile]
    if mixed_precision == "fsdp":
        return [profile.model_copy(update={"graph": with_precision(profile.graph, "autocast"), "data_axis": False}),
                profile.model_copy(update={"graph": with_precision(profile.graph, "fsdp"), "data_axis": True})]
    return [profile.model_copy(update={"graph": with_precision(profile.graph, mixed_precision)})]


def pricing_of(priced: list[ModelProfile], dp: int) -> ModelProfile:
    """Which of `precision_spaces` prices a mesh with `dp` data-parallel ranks."""
    return next(p for p in priced if p.data_axis in (None, dp > 1))


def priced_baselines(priced: list[ModelProfile], mode: str, devices: int, max_tp: int | None,
                     shard_dp: bool) -> dict[str, Candidate | None]:
    """`baselines` with each one priced by the profile its mesh runs under, checkpointed as `mode` says."""
    found: dict[str, Candidate | None] = {}
    for profile in priced:
        found.update(baselines(checkpointed_space(profile, mode), devices, max_tp, shard_dp))
    return {name: found[name] for name in ("data-parallel", "megatron", "fsdp") if name in found}


# Why a tolerance: with nothing fitting, a few percent of activation memory is not what a user
# acts on (they add devices or shrink the model), while tensor parallelism across nodes steps
# several times slower than the same split within nodes (GPT-3 175B on 16 H200s: tp 16 needs
# 206 GiB, pp 2 x tp 8 needs 211 GiB and steps 3.4x faster under the cost model).
CLOSE_TO_LEAST_MEMORY = 0.05


def tp_within_node(cand: Candidate) -> bool:
    """Whether every stage's tensor-parallel group lies inside one node (tp is the innermost
    axis, so its group is `tp` consecutive ranks)."""
    return all(cand.tp <= st.mesh.devices_per_node for st in cand.stages)


def closest_to_fitting(pool: list[Candidate]) -> Candidate:
    """The layout to report when nothing fits: the least memory (then the fastest), unless that
    puts tensor parallelism across nodes and a layout keeping it within nodes needs at most
    CLOSE_TO_LEAST_MEMORY more: then the least-memory such layout."""
    best = min(pool, key=lambda c: (c.memory_bytes, c.time_s))
    if tp_within_node(best):
        return best
    close = [c for c in pool if tp_within_node(c) and c.memory_bytes <= best.memory_bytes * (1 + CLOSE_TO_LEAST_MEMORY)]
    return min(close, key=lambda c: (c.memory_bytes, c.time_s)) if close else best


def checkpointed_space(profile: ModelProfile, mode: str) -> ModelProfile:
    """`profile` with its graph's layers checkpointed as `mode` says."""
    if mode == profile.activation_checkpointing:
        return profile
    return profile.model_copy(update={"graph": checkpointed(profile.graph, mode), "activation_checkpointing": mode})


def spaces(priced: ModelProfile | list[ModelProfile], shard_dp: bool,
           ac_modes: tuple[str, ...] = ("none",)) -> list[ModelProfile]:
    """The search spaces: per activation checkpointing mode and pricing (`precision_spaces`),
    replicated dp and, where allowed and the pricing has meshes with a data axis, sharded dp
    (FSDP) freeing gathered weights after forward or keeping them (a plan choice: fewer gathers
    for more memory)."""
    out = []
    for mode in ac_modes:
        for profile in priced if isinstance(priced, list) else [priced]:
            space = checkpointed_space(profile, mode)
            out.append(space)
            if shard_dp and profile.data_axis is not False:
                out += [space.model_copy(update={"shard_dp": True, "reshard_after_forward": r}) for r in (True, False)]
    return out


def exhaustive_search(source: ModelProfile | Graph, devices: int, memory_limit_bytes: int | None = None,
                      max_tp: int | None = None, max_pp: int | None = None, **kwargs: object) -> Plan:
    """`plan_model` with brute force in place of the DP, over the same space (small graphs only:
    one beyond `dp.BRUTE_FORCE_MAX_OPS` is refused up front, before any stage is searched)."""
    graph = source.graph if isinstance(source, ModelProfile) else source
    if len(graph.ops) > dp.BRUTE_FORCE_MAX_OPS:
        raise ValueError(f"brute force enumerates at most {dp.BRUTE_FORCE_MAX_OPS} ops (one array axis each), "
                         f"this graph has {len(graph.ops)}: plan it with the DP (plan_model)")
    return plan_model(source, devices, memory_limit_bytes, max_tp, max_pp, method="exhaustive", **kwargs)


def search_counts(graph: Graph, profile: ModelProfile, devices: int, method: Method = "dp",
                  full: bool = False) -> StageResult:
    """PaSE's own space (per-dim split counts, aligned layouts), unconstrained: for benchmarks."""
    mesh = counts_mesh(devices, profile.comm.devices_per_node, full)
    res, _ = solve_stage(graph, CostModel(graph, profile.device, profile.comm, mesh), None, method=method)
    return res


def plan_options(source: ModelProfile | Graph, devices: int, memory_limit_bytes: int | None = None,
                 max_tp: int | None = None, max_pp: int | None = None, *, device_kind: str = "cuda",
                 devices_per_node: int | None = None, shard_dp: bool = True, searched: Plan | None = None,
                 mixed_precision: str | None = None) -> list[Plan]:
    """The search's choice and every baseline that fits, as Plans, fastest first: for a choice
    that weighs more than step time (re-planning a running job also pays for moving its
    checkpoint onto the new plan, which differs from plan to plan). `searched`: `plan_model`'s
    result for the same arguments, when the caller has it (the search is not run twice).
    Baselines are priced as `plan_model` prices them (`mixed_precision`)."""
    best = searched or plan_model(source, devices, memory_limit_bytes, max_tp, max_pp, device_kind=device_kind,
                                  devices_per_node=devices_per_node, shard_dp=shard_dp, mixed_precision=mixed_precision)
    profile = _as_profile(source, device_kind, devices_per_node)
    limit = memory_limit_bytes if memory_limit_bytes is not None else profile.device.memory_bytes
    priced = precision_spaces(profile, mixed_precision)
    base = priced_baselines(priced, "none", devices, max_tp, shard_dp)
    options = [best] + [to_plan(c, devices, base, limit, priced[0].graph) for c in base.values()
                        if c is not None and c.fits(limit)]
    unique: dict[tuple[object, ...], Plan] = {}
    for plan in options:
        key = (tuple(sorted(plan.mesh.items())), plan.dp_shard, plan.reshard_after_forward,
               tuple((p.op, tuple(sorted(p.splits.items()))) for p in plan.placements))
        unique.setdefault(key, plan)
    return sorted(unique.values(), key=lambda p: p.estimated_step_s if p.estimated_step_s is not None else float("inf"))
