"""The planner's per-op choice in the trainer's terms (planner/execution.py), and the Plan
contract's own checks (specs/plan.py): no processes."""

from __future__ import annotations

import pytest
from parashift.planner.builders import gpt_graph, inception_graph
from parashift.planner.execution import executable
from parashift.planner.graph import Graph
from parashift.specs.plan import OpPlacement, Plan, TensorParallel
from pydantic import ValidationError

GRAPH = gpt_graph(2, 48, 4, 256, 24, 8)
LAYER_OPS = ("ln1", "qkv", "attn", "proj", "add1", "ln2", "fc1", "fc2", "add2")


def placements_for(graph: Graph, splits: dict[str, dict[str, tuple[str, ...]]]) -> list[OpPlacement]:
    """Placements for every op of `graph`, from `{op name: splits}` (absent: not split)."""
    return [OpPlacement(op=op.name, splits=splits.get(op.name, {})) for op in graph.ops]


def splits(**by_part: str) -> dict[str, dict[str, tuple[str, ...]]]:
    """{op: splits} splitting each named part's dim over tp (parts: embed, sequence, attention,
    mlp, head, loss)."""
    dims = {"embed": "v", "sequence": "s", "attention": "h", "mlp": "f", "head": "v", "loss": "v"}
    return {op.name: {dims[op.part]: ("tp",)} for op in GRAPH.ops if op.part in by_part}


def plan(mesh: dict[str, int], chosen: dict[str, dict[str, tuple[str, ...]]], **fields: object) -> Plan:
    from math import prod

    return Plan(devices=prod(mesh.values()), mesh=mesh, placements=placements_for(GRAPH, chosen), **fields)


def test_regions_come_from_the_parts_ops_split() -> None:
    out = executable(plan({"tp": 2}, splits(sequence="", attention="")), GRAPH)
    assert out.trainer_refusals == []
    assert out.tensor_parallel == TensorParallel(sequence=True, attention=(0, 1))
    everything = executable(plan({"dp": 2, "tp": 2}, splits(embed="", sequence="", attention="", mlp="", head="", loss="")), GRAPH)
    assert everything.tensor_parallel == TensorParallel.megatron(2)


def test_one_layer_mlp_only() -> None:
    chosen = {f"l1.{op}": {"f": ("tp",)} for op in ("fc1", "fc2")}
    assert executable(plan({"tp": 4}, chosen), GRAPH).tensor_parallel == TensorParallel(mlp=(1,))


def test_batch_only_over_tp_is_data_parallelism() -> None:
    chosen = {op.name: {"b": ("dp", "tp")} for op in GRAPH.ops}
    out = executable(plan({"dp": 2, "tp": 2}, chosen), GRAPH)
    assert out.mesh == {"dp": 4} and out.tensor_parallel is None and out.trainer_refusals == []
    assert all(p.splits == {"b": ("dp",)} for p in out.placements)


@pytest.mark.parametrize(("chosen", "reason"), [
    ({"l0.fc1": {"b": ("tp",)}, "l0.qkv": {"h": ("tp",)}}, "l0.fc1 splits ['b'] over tp"),
    ({"l0.qkv": {"h": ("tp",)}}, "layer 0's attention ops must split h over tp together"),
    ({"l0.ln1": {"s": ("tp",)}}, "every norm and residual add must split s"),
    ({"loss": {"v": ("tp",)}}, "the loss splits the vocabulary over tp but the head does not"),
    ({"l0.fc1": {"d": ("dp",), "f": ("tp",)}, "l0.fc2": {"f": ("tp",)}}, "l0.fc1 splits ['d'] over dp"),
])
def test_what_the_trainer_cannot_run_is_refused(chosen: dict, reason: str) -> None:
    out = executable(plan({"dp": 2, "tp": 2}, chosen), GRAPH)
    assert any(reason in r for r in out.trainer_refusals), out.trainer_refusals


def test_stage_layers_from_the_stage_op_lists() -> None:
    names = [op.name for op in GRAPH.ops]
    cut = names.index("l1.ln1")
    out = executable(plan({"pp": 2, "dp": 2}, {}, micro_batches=2, stages=[names[:cut], names[cut:]]), GRAPH)
    assert out.stage_layers == [[0], [1]] and out.trainer_refusals == []
    head_first = executable(plan({"pp": 2}, {}, micro_batches=2, stages=[names[cut:], names[:cut]]), GRAPH)
    assert any("embedding must sit on the first" in r for r in head_first.trainer_refusals)


def test_a_graph_the_trainer_does_not_run() -> None:
    g = inception_graph(batch=8)
    out = executable(Plan(devices=2, mesh={"tp": 2}, placements=placements_for(g, {})), g)
    assert any("not a model the trainer runs" in r for r in out.trainer_refusals)


def test_planner_plans_for_gpt_carry_the_contract() -> None:
    from parashift.planner.search import plan_model

    for devices in (2, 4):
        for kw in ({"max_pp": 1}, {"max_tp": 1}, {}):
            p = plan_model(GRAPH, devices, int(2e5), **kw)
            assert p.trainer_refusals == []
            if p.degree("tp") > 1:
                assert p.tensor_parallel is not None
            if p.degree("pp") > 1:
                assert p.stage_layers


@pytest.mark.parametrize(("fields", "message"), [
    ({"mesh": {"dp": 4}, "dp_shard": 3}, "dp_shard 3 must divide the dp degree 4"),
    ({"mesh": {"dp": 4}, "tensor_parallel": TensorParallel()}, "no tp axis"),
    ({"mesh": {"pp": 2, "dp": 2}, "stage_layers": [[0], [2]]}, "contiguous"),
    ({"mesh": {"pp": 2, "dp": 2}, "stage_layers": [[0, 1]]}, "1 stage layer lists for a pp degree of 2"),
])
def test_the_contract_checks_itself(fields: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        Plan(devices=4, **fields)


def test_tensor_parallel_checks_itself() -> None:
    with pytest.raises(ValidationError, match="needs the head"):
        TensorParallel(loss_parallel=True)
    with pytest.raises(ValidationError, match="distinct, ascending"):
        TensorParallel(mlp=(1, 0))
    assert Plan(devices=4, mesh={"dp": 4}, dp_shard=2).dp_replicate == 2
    assert Plan(devices=6, mesh={"pp": 3, "dp": 2}).layers_per_stage(7) == [[0, 1, 2], [3, 4], [5, 6]]
