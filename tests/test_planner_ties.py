"""The planner searches only what the trainer executes, for graphs that declare it (gpt_graph):
per-op `tp_dims` restrict configurations, tie groups keep regions consistent, and the search is
still exact over that restricted space. Graphs that declare nothing are searched as before."""

from __future__ import annotations

from itertools import product

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from parashift.planner import dp
from parashift.planner.builders import gpt_graph, inception_graph, pase_transformer_graph
from parashift.planner.comm import default_comm
from parashift.planner.configs import Config, Mesh, mesh_configs, named_mesh, splits_on
from parashift.planner.costs import CostModel
from parashift.planner.execution import executable
from parashift.planner.graph import Graph, graph_to_json
from parashift.planner.pipeline import block_order, stage_ops, stage_splits
from parashift.planner.problem import Weights, build_problem, tie_factors
from parashift.planner.profile import DEFAULT_DEVICES, profile_gpt, profile_graph
from parashift.planner.search import exhaustive_search, plan_model
from parashift.planner.stage import TieVariants, solve_stage
from parashift.specs.plan import OpPlacement, Plan, plan_refusals
from test_planner_dp import _meshes, graphs

# The trainer's per-op rule over "tp" (planner/execution.py), written out here to check the
# declarations against it.
TRAINER_TP = {"embed": {"v"}, "head": {"v"}, "loss": {"v"}, "ln_f": {"s"}, "ln1": {"s"}, "ln2": {"s"},
              "add1": {"s"}, "add2": {"s"}, "qkv": {"h"}, "attn": {"h"}, "proj": {"h"}, "fc1": {"f"}, "fc2": {"f"}}


def _trainer_dims(op: str) -> set[str]:
    return TRAINER_TP[op.split(".")[-1]]


def _reference_configs(op, mesh: Mesh) -> list[Config]:
    """The configuration space without op restrictions, for graphs that declare nothing: every
    axis splits nothing or any splittable dim, except "dp", which splits the batch (where the
    op has one and it splits evenly; replicated otherwise)."""
    split = [i for i, d in enumerate(op.dims) if d not in op.nosplit and op.dims[d] > 1]
    batch = [i for i in split if list(op.dims)[i] == mesh.batch_dim]

    def even(targets: list[list[int | None]]) -> list[Config]:
        out = []
        for choice in product(*targets):
            axes: list[list[int]] = [[] for _ in op.dims]
            for a, dim in enumerate(choice):
                if dim is not None:
                    axes[dim].append(a)
            counts = tuple(int(np.prod([mesh.sizes[a] for a in ax])) for ax in axes)
            if all(n % c == 0 for n, c in zip(op.dims.values(), counts, strict=True)):
                out.append(Config(tuple(tuple(ax) for ax in axes), counts))
        return out

    free = [None, *split]
    return (even([(batch or [None]) if n in mesh.batch_only else free for n in mesh.names])
            or even([[None] if n in mesh.batch_only else free for n in mesh.names]))


MESHES = [named_mesh(1, 2), named_mesh(2, 2), named_mesh(1, 4), named_mesh(2, 4), named_mesh(1, 8)]


def test_gpt_configurations_are_the_trainers() -> None:
    """Each GPT op's configurations are exactly the unrestricted ones whose "tp" split the trainer
    implements (or none), in the same order; "dp" splits only the batch."""
    g = gpt_graph(2, 64, 4, 256, 32, 8)
    for mesh in MESHES:
        tp = mesh.names.index("tp")
        for op in g.ops:
            allowed = _trainer_dims(op.name)
            want = [c for c in _reference_configs(op, mesh)
                    if all(d in allowed for d, ax in zip(op.dims, c.axes, strict=True) if tp in ax)]
            assert mesh_configs(op, mesh) == want, (op.name, mesh)


@pytest.mark.parametrize("graph", [pase_transformer_graph(batch=8, seq_len=32, layers=2), inception_graph(batch=8)])
def test_graphs_that_declare_nothing_are_searched_as_before(graph: Graph) -> None:
    """Same configurations in the same order, no tie tables, no tie variants: the same problem."""
    assert not graph.tp_groups() and all(op.tp_dims is None and op.tp_needs is None for op in graph.ops)
    assert TieVariants(graph).groups == []
    device, comm = DEFAULT_DEVICES["cuda"], default_comm("cuda")
    for mesh in MESHES:
        costs = CostModel(graph, device, comm, mesh)
        for op in graph.ops:
            assert costs.op_cost(op).configs == _reference_configs(op, mesh), op.name
        assert tie_factors(graph, costs) == []
        problem = build_problem(graph, costs)
        assert len(problem.factors) == len(graph.ops) + len(graph.edges)


def test_tie_declarations_round_trip_json(tmp_path) -> None:
    g = gpt_graph(2, 64, 4, 256, 32, 4)
    back = Graph.model_validate_json(graph_to_json(g))
    assert back == g
    assert back.op("loss").tp_needs == "head" and back.op("l1.fc2").tp_group == "l1.mlp"
    assert back.op("l0.add1").tp_dims == ("s",) and back.tp_groups()["sequence"][-1] == "ln_f"
    with pytest.raises(ValueError, match="tp_dims"):
        Graph.model_validate({**g.model_dump(), "ops": [{**g.ops[0].model_dump(), "tp_dims": ["x"]}]})


def _executable(plan: Plan, n_layers: int, n_heads: int, seq_len: int, batch: int) -> None:
    reasons = plan_refusals(plan, n_layers=n_layers, n_heads=n_heads, seq_len=seq_len, global_batch=batch)
    assert reasons == [], (plan.mesh, plan.micro_batches, reasons)


# (layers, d_model, heads, vocab, seq, batch): heads and seq divisible by some tp degrees only.
SIZES = [(2, 64, 4, 256, 32, 8), (4, 256, 8, 1024, 64, 32), (2, 48, 4, 256, 24, 8), (3, 512, 8, 2048, 128, 16)]


@pytest.mark.parametrize("size", SIZES)
def test_every_planner_plan_for_gpt_is_executable(size: tuple[int, ...]) -> None:
    """p in 2, 4, 8; no limit, and limits that force tensor or pipeline parallelism (or that
    nothing fits); every plan the planner returns passes the trainer's refusal check."""
    layers, d, heads, vocab, seq, batch = size
    prof = profile_graph(gpt_graph(*size), "cuda", devices_per_node=4)
    kinds = set()
    for p in (2, 4, 8):
        free = plan_model(prof, p, None, max_pp=1, max_tp=1)
        for fraction in (None, 0.5, 0.3, 0.15):
            limit = None if fraction is None else int(free.memory_per_device_bytes * fraction)
            for kw in ({}, {"max_pp": 1}, {"max_tp": 1}):
                plan = plan_model(prof, p, limit, **kw)
                _executable(plan, layers, heads, seq, batch)
                if plan.degree("tp") > 1:
                    kinds.add(("pp" if plan.degree("pp") > 1 else "tp", plan.tp_regions(layers).sequence))
    assert kinds, "the limits never forced tensor parallelism"


def test_pipelines_with_tensor_parallelism_are_executable() -> None:
    """Pipelined tp plans: every sequence-parallel state is searched, stage by stage consistent."""
    prof = profile_graph(gpt_graph(4, 256, 8, 1024, 64, 32), "cuda", devices_per_node=4)
    free = plan_model(prof, 8, None, max_pp=1, max_tp=1, shard_dp=False)
    plan = plan_model(prof, 8, int(free.memory_per_device_bytes * 0.15), shard_dp=False)
    assert plan.degree("pp") > 1 and plan.degree("tp") > 1, plan.mesh
    assert any(n.startswith("tie groups across stages: sequence") for n in plan.notes), plan.notes
    _executable(plan, 4, 8, 64, 32)
    variants = TieVariants(prof.graph).for_mesh(2, 1, 4, 4)
    assert [n for _, n in variants] == ["tie groups across stages: sequence off", "tie groups across stages: sequence on"]
    assert TieVariants(prof.graph).for_mesh(1, 2, 4, 4) == [(prof.graph, None)]  # one stage: the DP ties it
    # seq 6 does not split 4 ways: only "off" is searched there.
    odd = gpt_graph(4, 64, 4, 256, 6, 8)
    assert [n for _, n in TieVariants(odd).for_mesh(2, 1, 4, 4)] == ["tie groups across stages: sequence off"]


def test_local_groups_never_cross_a_stage_boundary() -> None:
    """Groups not fixed per candidate (all but "sequence") always land in one stage."""
    g = gpt_graph(6, 64, 4, 256, 32, 8)
    assert g.spanning_tp_groups() == ["sequence"]
    blocks = block_order(g)
    for pp in (2, 3, 4, 6):
        for counts in stage_splits(len(blocks), pp):
            where = {n: s for s, names in enumerate(stage_ops(g, blocks, counts)) for n in names}
            for group, names in g.tp_groups().items():
                if group != "sequence":
                    assert len({where[n] for n in names}) == 1, (group, counts)
            assert where["loss"] == where["head"]


def _trainer_accepts(g: Graph, mesh: Mesh, assign: list[int], costs: CostModel) -> bool:
    placements = [OpPlacement(op=op.name, splits=costs.op_cost(op).configs[i].splits(op, mesh))
                  for op, i in zip(g.ops, assign, strict=True)]
    degrees = dict(zip(mesh.names, mesh.sizes, strict=True))
    plan = Plan(devices=mesh.devices, mesh=degrees, placements=placements, strategy="test")
    return not executable(plan, g).trainer_refusals


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("lam", [0.0, 1e-8])
def test_tied_dp_equals_brute_force_over_what_the_trainer_accepts(tp: int, lam: float) -> None:
    """On a 1-layer GPT (13 ops), every assignment of the restricted configurations is checked
    by planner.execution, the one translation into what the trainer executes; the DP with tie tables finds the cheapest accepted one."""
    g = gpt_graph(1, 64, 4, 128, 16, 8)
    mesh = named_mesh(1, tp)
    costs = CostModel(g, DEFAULT_DEVICES["cuda"], default_comm("cuda"), mesh)
    w = Weights(weight=2.0, inflight=2.0)
    tied = build_problem(g, costs, lam, w)
    assign, value = dp.solve(tied)
    untied_graph = g.model_copy(update={"ops": [op.model_copy(update={"tp_group": None, "tp_needs": None})
                                                for op in g.ops]})
    untied = build_problem(untied_graph, costs, lam, w)
    assert len(untied.factors) < len(tied.factors)
    full = dp._combine(untied.factors, tuple(range(len(g.ops))), untied.card)
    assert full.size == 2 ** len(g.ops)  # each op: its trainer dim over tp, or nothing
    accepted = 0
    for flat in np.argsort(full, axis=None, kind="stable"):  # cheapest first, to the first accepted
        idx = [int(i) for i in np.unravel_index(flat, full.shape)]
        if _trainer_accepts(g, mesh, idx, costs):
            best = float(full.reshape(-1)[flat])
            break
        accepted += 1
    if lam:  # there the cheapest assignment breaks a tie (sequence parallel on some norms only)
        assert accepted > 0
    assert value == pytest.approx(best, rel=1e-12)
    assert _trainer_accepts(g, mesh, assign, costs)
    assert dp.brute_force(tied)[1] == pytest.approx(best, rel=1e-12)


@pytest.mark.parametrize("fraction", [None, 0.7, 0.55, 0.48])
def test_restricted_search_equals_exhaustive_search(fraction: float | None) -> None:
    g = gpt_graph(1, 64, 4, 128, 16, 8)
    prof = profile_graph(g, "cuda")
    limit = None
    if fraction is not None:
        limit = int(plan_model(prof, 2, None, max_tp=1, shard_dp=False).memory_per_device_bytes * fraction)
    a = plan_model(prof, 2, limit, max_pp=1, shard_dp=False)
    b = exhaustive_search(prof, 2, limit, max_pp=1, shard_dp=False)
    assert a.estimated_step_s == pytest.approx(b.estimated_step_s, rel=1e-12)
    assert a.memory_per_device_bytes == b.memory_per_device_bytes
    _executable(a, 1, 4, 16, 8)
    if fraction is not None:  # these limits force tensor parallelism, with mixed choices
        assert a.degree("tp") == 2 and a.feasible


@pytest.mark.parametrize("fraction", [None, 0.7, 0.5, 0.4, 0.3])
def test_search_with_sharded_dp_equals_exhaustive_search(fraction: float | None) -> None:
    """With the dp axis allowed to shard parameter state (FSDP), the DP and brute force over the
    same two spaces agree, and tight limits are met by sharding parameter state (FSDP) or, tighter
    still, the weights themselves (tp: autocast's bf16 copies of the weights are sharded too)."""
    g = gpt_graph(1, 64, 4, 128, 16, 8)
    prof = profile_graph(g, "cuda")
    limit = None
    if fraction is not None:
        limit = int(plan_model(prof, 4, None, max_tp=1, shard_dp=False).memory_per_device_bytes * fraction)
    a = plan_model(prof, 4, limit, max_pp=1)
    b = exhaustive_search(prof, 4, limit, max_pp=1)
    assert a.estimated_step_s == pytest.approx(b.estimated_step_s, rel=1e-12)
    assert (a.memory_per_device_bytes, a.dp_shard, a.mesh) == (b.memory_per_device_bytes, b.dp_shard, b.mesh)
    _executable(a, 1, 4, 16, 8)
    if fraction is not None and fraction <= 0.4:
        assert a.feasible and (a.dp_shard > 1 or a.degree("tp") > 1), (a.mesh, a.dp_shard, a.feasible)
    if fraction == 0.4:
        assert a.dp_shard > 1


def _random_ties(graph: Graph, data: st.DataObject) -> Graph:
    """Random tp_dims, tie groups and needs on a random DAG (graphs of test_planner_dp)."""
    ops = []
    for op in graph.ops:
        dims = sorted(op.dims)
        tp_dims = data.draw(st.one_of(st.none(), st.lists(st.sampled_from(dims), max_size=2, unique=True).map(tuple)))
        group = data.draw(st.sampled_from([None, "A", "B"]))
        needs = data.draw(st.sampled_from([None, None, "A", "B"]))
        ops.append(op.model_copy(update={"tp_dims": tp_dims, "tp_group": group, "tp_needs": needs}))
    return graph.model_copy(update={"ops": ops})


def _ties_hold(g: Graph, costs: CostModel, assign: list[int]) -> bool:
    axis = costs.mesh.names.index("tp")
    on = {op.name: splits_on(costs.op_cost(op).configs[i], axis) for op, i in zip(g.ops, assign, strict=True)}
    groups = g.tp_groups()
    state = {name: {on[n] for n in names} for name, names in groups.items()}
    if any(len(s) > 1 for s in state.values()):
        return False
    return all(not on[op.name] or op.tp_needs not in groups or state[op.tp_needs] == {True} for op in g.ops)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph=graphs(max_ops=5), p=st.sampled_from([2, 4, 8]), data=st.data())
def test_dp_with_ties_matches_brute_force_on_random_dags(graph: Graph, p: int, data: st.DataObject) -> None:
    g = _random_ties(graph, data)
    device, comm = DEFAULT_DEVICES["cuda"], default_comm("cuda", devices_per_node=4)
    for mesh in _meshes(p):
        if "tp" not in mesh.names:
            continue
        costs = CostModel(g, device, comm, mesh)
        problem = build_problem(g, costs, 1e-12, Weights(weight=2.0, inflight=2.0))
        if np.prod(problem.card, dtype=np.float64) > 2e6:
            continue
        assign, value = dp.solve(problem)
        brute_assign, brute = dp.brute_force(problem)
        assert value == pytest.approx(brute, rel=1e-9, abs=1e-15)
        assert np.isfinite(value)  # nothing over tp always keeps every tie
        assert _ties_hold(g, costs, assign) and _ties_hold(g, costs, brute_assign)


def test_least_memory_keeps_ties() -> None:
    """When each op's least-memory configuration breaks a tie, the floor is the exact least
    memory over the assignments that keep them (the bisection's fit test relies on it)."""
    from parashift.planner.graph import Edge, Op

    ops = [Op(name="a", dims={"b": 4, "f": 8}, inputs=(("b", "f"),), output=("b", "f"), params=(("f",),),
              tp_dims=("f",), tp_group="g"),
           Op(name="c", dims={"b": 4, "f": 8, "k": 3}, inputs=(("b", "f"),), output=("b", "k"), reduce=("f",),
              params=(("f", "k"),), tp_dims=("k",), tp_group="g")]  # k = 3 never splits 2 ways
    g = Graph(ops=ops, edges=[Edge(src="a", dst="c")])
    costs = CostModel(g, DEFAULT_DEVICES["cuda"], default_comm("cuda"), named_mesh(1, 2))
    a = costs.op_cost(ops[0])
    assert splits_on(a.configs[int((a.param_mem + a.act_mem).argmin())], 0)  # alone, a would split
    res, _ = solve_stage(g, costs, 1.0)  # nothing fits 1 byte: the floor comes back
    problem = build_problem(g, costs, memory_only=True)
    _, brute = dp.brute_force(problem)
    assert res.memory_bytes == pytest.approx(brute)
    assert not any(splits_on(costs.op_cost(op).configs[i], 0) for op, i in zip(g.ops, res.assign, strict=True))


def test_choose_plan_keeps_planner_plans_and_falls_back_only_on_refusal(tmp_path) -> None:
    from jobs import tiny_spec
    from parashift.tasks import profile as profile_task
    from parashift.tasks.plan import choose_plan

    spec = tiny_spec("ties", f"file://{tmp_path}/store", parallelism={"strategy": "auto"},
                     model={"n_layers": 2, "d_model": 48, "n_heads": 4, "vocab_size": 256, "seq_len": 24})
    m = spec.model
    prof = profile_gpt(m.n_layers, m.d_model, m.n_heads, m.vocab_size, m.seq_len, spec.training.global_batch, "cpu")
    roofline = prof.device.model_copy(update={"op_overhead_s": 0.0, "sharded_op_overhead_s": 0.0})
    prof = prof.model_copy(update={"device": roofline})
    for p, kw in ((4, {"max_pp": 1}), (4, {}), (2, {}), (3, {"max_pp": 1})):
        free = plan_model(prof, p, None, max_pp=1, max_tp=1)
        for fraction in (None, 0.5, 0.3):
            limit = None if fraction is None else int(free.memory_per_device_bytes * fraction)
            searched = plan_model(prof, p, limit, **kw)
            assert choose_plan(spec, searched, p) is searched
    # Profiles cached by an older planner (graphs without the declarations) are not reused.
    key = profile_task.profile_key(spec)
    profile_task.PROFILE_FORMAT += 1
    try:
        assert profile_task.profile_key(spec) != key
    finally:
        profile_task.PROFILE_FORMAT -= 1
    refused = executable(Plan(devices=2, mesh={"tp": 2}, strategy="hand",
                              placements=[OpPlacement(op="l0.fc1", splits={"b": ("tp",)}),
                                          OpPlacement(op="l0.qkv", splits={"h": ("tp",)})]), prof.graph)
    assert any("l0.fc1 splits ['b'] over tp" in r for r in refused.trainer_refusals), refused.trainer_refusals
    fallback = choose_plan(spec, refused, 2)
    assert fallback.mesh == {"dp": 2} and "refused by the trainer" in fallback.notes[-1]
    # Data parallel by the spec: the note names the planner's choice as the run summary does
    searched = plan_model(prof, 2, None, max_pp=1)
    note = choose_plan(tiny_spec("dp", f"file://{tmp_path}/store"), searched, 2).notes[-1]
    assert note.startswith(f"strategy data-parallel; the planner's choice would be {searched.describe()} at "), note
    assert "{" not in note, note


def test_no_plan_breaks_a_tie_not_even_a_baseline() -> None:
    """Two tied ops, one of which cannot split over tp on 2 devices: Megatron's layout would
    split one and not the other, which the trainer refuses; it is no candidate."""
    from parashift.planner.graph import Edge, Op
    from parashift.planner.search import baselines

    ops = [Op(name="a", dims={"b": 4, "f": 8}, inputs=(("b", "f"),), output=("b", "f"), params=(("f",),),
              tp_dims=("f",), tp_dim="f", tp_group="g"),
           Op(name="c", dims={"b": 4, "f": 8, "k": 3}, inputs=(("b", "f"),), output=("b", "k"), reduce=("f",),
              params=(("f", "k"),), tp_dims=("k",), tp_group="g")]  # Megatron leaves c replicated
    profile = profile_graph(Graph(ops=ops, edges=[Edge(src="a", dst="c")]), "cuda")
    base = baselines(profile, 2, None)
    assert "megatron" in base and base["megatron"] is None
    for plan in (plan_model(profile, 2), exhaustive_search(profile, 2)):
        on = {p.op: any("tp" in axes for axes in p.splits.values()) for p in plan.placements}
        assert on["a"] == on["c"], plan.placements
