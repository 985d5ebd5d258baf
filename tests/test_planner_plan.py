"""Plans on real model graphs: never worse than the baselines, memory-aware, executable, JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from parashift.planner.builders import gpt_graph, inception_graph, pase_transformer_graph
from parashift.planner.configs import dtensor_placements, named_mesh
from parashift.planner.costs import CostModel
from parashift.planner.graph import Graph, graph_to_json, load_graph_json
from parashift.planner.profile import measure_device, profile_gpt, profile_graph
from parashift.planner.search import CLOSE_TO_LEAST_MEMORY, candidates, exhaustive_search, plan_model
from parashift.specs.plan import Plan

REPO = Path(__file__).resolve().parents[1]


@settings(max_examples=12, deadline=None)
@given(layers=st.integers(1, 4), d=st.sampled_from([64, 256, 1024]), batch=st.sampled_from([8, 16, 64]),
       p=st.sampled_from([2, 4, 8, 16]), kind=st.sampled_from(["cpu", "cuda"]))
def test_gpt_plan_never_worse_than_baselines(layers: int, d: int, batch: int, p: int, kind: str) -> None:
    prof = profile_gpt(layers, d, 8, 1024, 128, batch, kind)
    plan = plan_model(prof, p, memory_limit_bytes=None, max_pp=2)
    assert plan.baselines, plan.notes
    for name, t in plan.baselines.items():
        assert plan.estimated_step_s <= t * (1 + 1e-9), (name, plan.estimated_step_s, t)


@pytest.mark.parametrize("kind", ["cpu", "cuda"])
def test_one_device_communicates_nothing_and_its_optimizer_update_is_device_work(kind: str) -> None:
    """`parashift plan` on one device showed "comm ms" on every op with weights: the optimizer's
    update (reading and writing the parameter state once per step) was booked as communication.
    It is the device's work; the step's time is the same sum either way."""
    prof = profile_gpt(2, 256, 4, 1024, 128, 8, kind)
    alone = plan_model(prof, 1, memory_limit_bytes=None)
    assert all(p.comm_s == 0 for p in alone.placements), [(p.op, p.comm_s) for p in alone.placements if p.comm_s]
    assert sum(p.compute_s for p in alone.placements) == pytest.approx(alone.estimated_step_s, rel=1e-12)
    costs = CostModel(prof.graph, prof.device, prof.comm, named_mesh(1, 1, batch_dim=prof.graph.batch_dim))
    with_weights = [op for op in prof.graph.ops if op.params]
    assert with_weights and all(costs.op_cost(op).update[0] > 0 for op in with_weights)


def test_memory_forces_tensor_parallelism() -> None:
    """Replicated weights do not fit; sharded ones do: the plan must split weights over tp."""
    prof = profile_gpt(4, 2048, 16, 32768, 256, 8, "cuda")
    replicated = plan_model(prof, 4, memory_limit_bytes=None, max_pp=1, max_tp=1, shard_dp=False)
    limit = int(replicated.memory_per_device_bytes * 0.45)
    plan = plan_model(prof, 4, memory_limit_bytes=limit, max_pp=1)
    assert plan.feasible and plan.memory_per_device_bytes <= limit
    assert plan.degree("tp") > 1
    weight_ops = {op.name for op in prof.graph.ops if op.params and op.name.endswith(("qkv", "fc1", "fc2", "proj"))}
    split = [p for p in plan.placements if p.op in weight_ops and any("tp" in ax for d, ax in p.splits.items() if d != "b")]
    assert split, "weights must be split over tp"
    for name, t in plan.baselines.items():
        if plan.baseline_memory_bytes[name] <= limit:
            assert plan.estimated_step_s <= t * (1 + 1e-9)


def test_memory_forces_pipeline_when_tp_is_not_allowed() -> None:
    prof = profile_gpt(8, 1024, 16, 8192, 256, 16, "cuda")
    full = plan_model(prof, 4, memory_limit_bytes=None, max_pp=1, max_tp=1, shard_dp=False)
    limit = int(full.memory_per_device_bytes * 0.4)
    plan = plan_model(prof, 4, memory_limit_bytes=limit, max_tp=1, shard_dp=False)  # replicated dp only
    assert plan.feasible and plan.memory_per_device_bytes <= limit
    assert plan.degree("pp") > 1 and len(plan.stages) == plan.degree("pp")
    assert sum(len(s) for s in plan.stages) == len(prof.graph.ops)


def test_exhaustive_search_agrees_with_dp_on_a_small_graph() -> None:
    g = gpt_graph(1, 64, 4, 128, 16, 8)
    small = g.subgraph(["l0.ln1", "l0.qkv", "l0.attn", "l0.proj", "l0.add1"])
    prof = profile_graph(small, "cuda")
    a = plan_model(prof, 4, None, max_pp=1)
    b = exhaustive_search(prof, 4, None, max_pp=1)
    assert a.estimated_step_s == pytest.approx(b.estimated_step_s, rel=1e-12)


def test_non_chain_graphs_plan() -> None:
    for g, p in ((inception_graph(batch=32), 8), (pase_transformer_graph(batch=16, seq_len=64), 4)):
        plan = plan_model(profile_graph(g, "cuda"), p, None, max_pp=1)
        assert len(plan.placements) == len(g.ops)
        assert all(plan.estimated_step_s <= t * (1 + 1e-9) for t in plan.baselines.values())


def test_every_configuration_maps_to_dtensor_placements() -> None:
    g = gpt_graph(1, 64, 4, 128, 16, 8)
    mesh = named_mesh(2, 2)
    costs = CostModel(g, profile_graph(g).device, profile_graph(g).comm, mesh)
    for op in g.ops:
        for cfg in costs.op_cost(op).configs:
            places = dtensor_placements(op, cfg, mesh)
            assert set(places) == {f"in{i}" for i in range(len(op.inputs))} | {"out"} | {
                f"param{i}" for i in range(len(op.params))}
            for tensor, pl in places.items():
                assert len(pl) == len(mesh.sizes)
                assert all(x == "Replicate()" or x == "Partial()" or x.startswith("Shard(") for x in pl), tensor
    qkv = g.op("l0.qkv")
    megatron = next(c for c in costs.op_cost(qkv).configs if c.splits(qkv, mesh) == {"b": ("dp",), "h": ("tp",)})
    assert dtensor_placements(qkv, megatron, mesh) == {
        "in0": ("Shard(0)", "Replicate()"), "out": ("Shard(0)", "Shard(2)"), "param0": ("Replicate()", "Shard(1)")}
    proj = g.op("l0.proj")
    row = next(c for c in costs.op_cost(proj).configs if c.splits(proj, mesh) == {"b": ("dp",), "h": ("tp",)})
    assert dtensor_placements(proj, row, mesh)["out"] == ("Shard(0)", "Partial()")


def test_uneven_splits_are_pruned() -> None:
    g = gpt_graph(1, 96, 3, 100, 12, 6)  # 3 heads, vocab 100, batch 6
    costs = CostModel(g, profile_graph(g).device, profile_graph(g).comm, named_mesh(1, 4))
    for op in g.ops:
        for cfg in costs.op_cost(op).configs:
            assert all(n % c == 0 for n, c in zip(op.dims.values(), cfg.counts, strict=True))


def test_a_batch_that_does_not_divide_splits_over_dp_at_the_largest_share() -> None:
    """16 sequences on 3 data-parallel ranks run as shares of 6, 5 and 5 (the trainer's split):
    the plan splits the batch over dp, and each rank is charged the largest share, exactly what
    an even split of 18 costs. (Every op was replicated over dp instead, each rank costed with
    the whole batch: 0.0248 s against 0.0127 for the default GPT on 3 CPU devices, and no
    data-parallel baseline.) Other dims still split evenly or not at all."""
    uneven, even = (profile_gpt(2, 64, 4, 256, 32, batch, device_kind="cpu") for batch in (16, 18))
    plan = plan_model(uneven, 3, device_kind="cpu", shard_dp=False, max_tp=1, max_pp=1)
    assert plan.mesh == {"dp": 3}
    assert all(p.splits.get("b") == ("dp",) for p in plan.placements), plan.placements
    assert plan.estimated_step_s == pytest.approx(
        plan_model(even, 3, device_kind="cpu", shard_dp=False, max_tp=1, max_pp=1).estimated_step_s, rel=1e-9)
    assert not any("data-parallel baseline: not executable" in note for note in plan.notes), plan.notes
    g = gpt_graph(1, 96, 3, 100, 12, 6)
    costs = CostModel(g, profile_graph(g).device, profile_graph(g).comm, named_mesh(4, 1))
    for op in g.ops:
        for cfg in costs.op_cost(op).configs:
            assert all(n % c == 0 or d == g.batch_dim for (d, n), c in zip(op.dims.items(), cfg.counts, strict=True))


def test_graph_json_round_trip(tmp_path: Path) -> None:
    for g in (gpt_graph(2, 64, 4, 256, 32, 4), inception_graph(batch=8)):
        path = tmp_path / f"{g.name}.json"
        path.write_text(graph_to_json(g))
        back = load_graph_json(path)
        assert back == g
    with pytest.raises(ValueError, match="shape"):
        Graph.model_validate({**json.loads(graph_to_json(gpt_graph(1, 64, 4, 256, 32, 4))),
                              "edges": [{"src": "embed", "dst": "loss", "slot": 0}]})


def test_micro_batches_on_one_stage_are_called_gradient_accumulation() -> None:
    """Under a tight limit the planner splits the batch into micro-batches on a single stage:
    that is gradient accumulation, not a 1F1B pipeline (the plan used to say "+pipeline")."""
    prof = profile_gpt(2, 64, 4, 256, 32, 64, "cuda")
    roomy = plan_model(prof, 2, None)
    tight = plan_model(prof, 2, int(roomy.memory_per_device_bytes * 0.4))
    assert tight.feasible and tight.degree("pp") == 1 and tight.micro_batches > 1
    assert tight.strategy == "pase-dp+accumulation"
    assert f"one stage, {tight.micro_batches} micro-batches (gradient accumulation)" in tight.notes


def test_plan_json_round_trip() -> None:
    plan = plan_model(profile_gpt(2, 64, 4, 256, 32, 8, "cpu"), 4, None)
    assert Plan.model_validate_json(plan.model_dump_json()) == plan
    assert plan.devices == 4 and "data-parallel" in plan.baselines and "megatron" in plan.baselines


def test_cli_plan_json_and_table(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from parashift.cli import app

    spec = REPO / "specs" / "default.yaml"
    runner = CliRunner()
    out = runner.invoke(app, ["plan", str(spec), "--devices", "4", "--json"])
    assert out.exit_code == 0, out.output
    plan = Plan.model_validate_json(out.output)
    assert plan.devices == 4
    table = runner.invoke(app, ["plan", str(spec), "--devices", "2"])
    assert table.exit_code == 0, table.output
    assert "estimated step" in table.output and "megatron" in table.output
    # each fact on one line at the runner's 80 columns, in words ("1 micro-batch", "without ...")
    instead = next(line for line in table.output.splitlines() if "instead:" in line)
    assert instead.rstrip().endswith("per device") and "none checkpointing" not in table.output
    assert "1 micro-batches" not in table.output
    graph = tmp_path / "g.json"
    graph.write_text(graph_to_json(inception_graph(batch=8)))
    out = runner.invoke(app, ["plan", str(spec), "--devices", "2", "--graph", str(graph), "--json"])
    assert out.exit_code == 0, out.output
    assert len(Plan.model_validate_json(out.output).placements) == len(inception_graph(batch=8).ops)


def test_cli_plan_says_what_it_assumed_of_a_device_and_measures_none_it_lacks(tmp_path: Path) -> None:
    """A CUDA job planned on a machine without CUDA: the table says the device it assumed (the
    default, an H200's memory; the spec's memory_gb wins), and `--measure` is refused: it timed
    this CPU for the GPUs and planned an 8B Llama at 1e4 s per step with unlimited memory."""
    import torch
    from typer.testing import CliRunner

    from parashift.cli import app

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: --measure times it")
    spec = tmp_path / "gpu.yaml"
    spec.write_text((REPO / "specs" / "llama3-1b-cuda.yaml").read_text())
    runner = CliRunner()
    table = runner.invoke(app, ["plan", str(spec)])
    assert table.exit_code == 0, table.output
    assert "device: 395.6 TFLOP/s GEMM, 141.0 GiB" in table.output and "the cuda default: an H200" in table.output
    spec.write_text(spec.read_text().replace("  kind: cuda\n", "  kind: cuda\n  memory_gb: 80\n"))
    table = runner.invoke(app, ["plan", str(spec)])
    assert "80.0 GiB" in table.output and "memory from resources.memory_gb" in table.output, table.output
    refused = runner.invoke(app, ["plan", str(spec), "--measure"])
    assert refused.exit_code == 1 and "--measure times this machine's cuda devices, and it has none" in refused.output
    with pytest.raises(ValueError, match="no cuda device here"):
        measure_device("cuda", repeats=1)


def test_mesh_degrees_are_bounded_in_the_device_count() -> None:
    """Divisors, not a loop up to p: a billion devices enumerate at once, and every count
    agrees with the plain loop."""
    import time

    from parashift.planner.stage import divisors, mesh_degrees

    for n in range(1, 300):
        assert divisors(n) == [d for d in range(1, n + 1) if n % d == 0]
    started = time.perf_counter()
    meshes = mesh_degrees(10**9, None, None)
    assert time.perf_counter() - started < 1.0
    assert all(pp * dp * tp == 10**9 for pp, dp, tp in meshes) and (1, 1, 10**9) in meshes


def test_nothing_fits_returns_the_layout_closest_to_fitting() -> None:
    """GPT-3 175B on 8 H200s: no layout fits, and the plan is the least-memory one with what it
    needs, not the fastest one ignoring memory (data parallelism at 14.8 TB per device)."""
    from parashift.planner.builders import gpt3_175b_graph

    plan = plan_model(profile_graph(gpt3_175b_graph(), "cuda", memory_gb=141), 8)
    assert not plan.feasible
    gib = plan.memory_per_device_bytes / 2**30
    floor = 175e9 * 16 / 8 / 2**30
    # weights and optimizer state split 8 ways, autocast's bf16 weight copies, little more
    assert floor <= gib < 1.1 * 175e9 * (16 + 2) / 8 / 2**30, gib
    assert all(plan.memory_per_device_bytes <= m for m in plan.baseline_memory_bytes.values())
    from parashift.specs.words import gib as in_gib

    assert any("closest to fitting" in note and f"needing {in_gib(plan.memory_per_device_bytes)}" in note
               for note in plan.notes), plan.notes


def test_nothing_fits_keeps_tensor_parallelism_within_nodes_when_that_is_as_close(monkeypatch: pytest.MonkeyPatch) -> None:
    """GPT-3 175B on 16 H200s (two nodes of 8): tp 16 across both nodes needs the least memory
    (206 GiB), pp 2 x tp 8 within 2.3% of it and steps several times faster; neither fits, and
    the plan reported is the one an expert would start from, tensor parallelism inside a node.
    The layouts compared are the ones the planner enumerated itself, unpruned, to choose from
    (recorded, not searched a second time: that search is most of the test's time)."""
    from parashift.planner import search
    from parashift.planner.builders import gpt3_175b_graph
    from parashift.planner.stage import Candidate

    enumerated: list[Candidate] = []

    def recorded(*args: object, **kwargs: object) -> list[Candidate]:
        found = candidates(*args, **kwargs)  # type: ignore[arg-type]
        if kwargs.get("prune") is False and kwargs.get("skip_unfit") is False:
            enumerated.extend(found)
        return found

    monkeypatch.setattr(search, "candidates", recorded)
    prof = profile_graph(gpt3_175b_graph(), "cuda", memory_gb=141)
    plan = plan_model(prof, 16)
    assert not plan.feasible
    assert plan.mesh.get("tp", 1) <= 8, plan.mesh
    assert len(enumerated) > 100 and {c.tp for c in enumerated} >= {1, 2, 4, 8, 16}  # every mesh, none pruned
    least = min(enumerated, key=lambda c: c.memory_bytes)
    assert least.tp == 16  # what the rule overrides: the least memory alone crosses nodes
    assert plan.memory_per_device_bytes <= least.memory_bytes * (1 + CLOSE_TO_LEAST_MEMORY)
    assert plan.estimated_step_s < least.time_s


GOOD_GRAPH = {"ops": [{"name": "a", "dims": {"b": 4, "f": 8}, "inputs": [["b", "f"]], "output": ["b", "f"],
                       "params": [["f"]], "flops": 10.0},
                      {"name": "c", "dims": {"b": 4, "f": 8}, "inputs": [["b", "f"]], "output": ["b", "f"], "flops": 10.0}],
              "edges": [{"src": "a", "dst": "c"}]}


@pytest.mark.parametrize(
    ("change", "line"),
    [
        (lambda g: g["ops"][0]["dims"].update(b=-4), "ops[0].dims.b (op 'a'): Input should be greater than 0"),
        (lambda g: g["ops"][0]["dims"].update(b=0), "ops[0].dims.b (op 'a'): Input should be greater than 0"),
        (lambda g: g["ops"][1].update(flops=float("nan")), "ops[1].flops (op 'c'): Input should be a finite number"),
        (lambda g: g["ops"][1].update(flops=-1.0), "ops[1].flops (op 'c'): Input should be greater than or equal to 0"),
        (lambda g: g["edges"].append({"src": "c", "dst": "c"}), "edge c->c: an op cannot feed itself"),
        (lambda g: g["edges"].append({"src": "c", "dst": "a"}), "edge c->a: ops must be listed in topological order"),
        (lambda g: g["ops"][1].update(name="a"), "op names must be unique: 'a' appears more than once"),
        (lambda g: g["edges"].append({"src": "x", "dst": "c"}), "edge x->c: no op is named 'x'"),
        (lambda g: g["edges"].append({"src": "a", "dst": "c"}), "edge a->c: input slot 0 of c already has an edge"),
        (lambda g: g.update(act_bytes=-2), "act_bytes: Input should be greater than 0"),
        (lambda g: g.update(ops="nope"), "ops: Input should be a valid list"),
        (lambda g: g.update(ops=[], edges=[]), "ops: a graph to plan needs at least one op"),
        (lambda g: g.update(batch_dim="n"), "batch_dim: 'n' is not a dim of any op"),
        (lambda g: g["ops"][0]["dims"].update(b=2**50), "ops[0].dims.b (op 'a'): Input should be less than or equal to"),
        (lambda g: g["ops"][0].update(saved=[{"dims": ["z"], "bytes": 2}]), "ops[0] (op 'a'): op a: dims ['z'] not in"),
        (lambda g: g["ops"][0].update(params=[["f", "f"]]),
         "ops[0] (op 'a'): op a: tensor params[0] ['f', 'f'] names dim 'f' twice"),
        (lambda g: g["ops"][1].update(inputs=[["b", "b"]]),
         "ops[1] (op 'c'): op c: tensor inputs[0] ['b', 'b'] names dim 'b' twice"),
    ],
)
def test_malformed_graphs_are_refused_with_one_line(tmp_path: Path, change, line: str) -> None:
    """`parashift plan --graph`: the op and field at fault, one line, exit 1, no traceback."""
    from typer.testing import CliRunner

    from parashift.cli import app

    graph = json.loads(json.dumps(GOOD_GRAPH))
    change(graph)
    path = tmp_path / "g.json"
    path.write_text(json.dumps(graph))
    done = CliRunner().invoke(app, ["plan", "specs/default.yaml", "--graph", str(path)])
    assert done.exit_code == 1 and "Traceback" not in done.output, done.output
    assert done.output.strip().splitlines()[0].startswith(f"{path}: {line}"), done.output


def test_plan_input_that_cannot_be_planned(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from parashift.cli import app

    runner = CliRunner()
    (tmp_path / "t.json").write_text(json.dumps(GOOD_GRAPH)[:40])
    done = runner.invoke(app, ["plan", "specs/default.yaml", "--graph", str(tmp_path / "t.json")])
    assert done.exit_code == 1 and f"{tmp_path / 't.json'}: not JSON" in done.output
    for option in ("--devices", "-n"):
        for bad in ("0", "-1", "1e6", "100000000", "two"):
            done = runner.invoke(app, ["plan", "specs/default.yaml", option, bad])
            assert done.exit_code == 2 and "Traceback" not in done.output, done.output
            assert done.output.strip() == f"parashift plan: --devices must be a whole number from 1 to 65536 (got {bad!r})"
    (tmp_path / "ok.json").write_text(json.dumps(GOOD_GRAPH))
    assert runner.invoke(app, ["plan", "specs/default.yaml", "--graph", str(tmp_path / "ok.json")]).exit_code == 0
    done = runner.invoke(app, ["plan", "specs/default.yaml", "--graph", str(tmp_path / "ok.json"), "-n", "4", "--json"])
    assert done.exit_code == 0 and Plan.model_validate_json(done.output).devices == 4, done.output


def _one_op_graph(d: int) -> dict:
    """One op that must split its `d` over "tp" (tp_required), on a batch of 8."""
    return {"ops": [{"name": "fc", "kind": "matmul", "dims": {"b": 8, "d": d}, "inputs": [["b", "d"]],
                     "output": ["b", "d"], "params": [["d"]], "flops": 1e6, "tp_dims": ["d"], "tp_required": True}]}


@pytest.mark.parametrize("devices", [1, 2, 3, 4, 7, 8])
def test_a_required_tp_split_that_cannot_divide_leaves_the_other_meshes(tmp_path: Path, devices: int) -> None:
    """d = 7 splits over tp = 7 only: on every other mesh with a "tp" axis the op has no
    configuration, and that mesh is left out, not the whole search (it failed on a minimum
    over no configurations); data parallelism plans it on every device count."""
    from typer.testing import CliRunner

    from parashift.cli import app

    path = tmp_path / "g.json"
    path.write_text(json.dumps(_one_op_graph(7)))
    for extra in ([], ["--exhaustive"]):
        done = CliRunner().invoke(app, ["plan", "specs/default.yaml", "--graph", str(path), "-n", str(devices),
                                        "--json", *extra])
        assert done.exit_code == 0, done.output
        plan = Plan.model_validate_json(done.output)
        assert plan.devices == devices and plan.placements[0].op == "fc"
        tp = plan.mesh.get("tp", 1)
        assert tp == 1 or 7 % tp == 0, plan.mesh
        assert ("d" in plan.placements[0].splits) == (tp > 1), plan.placements[0].splits
    prof = profile_graph(load_graph_json(path), "cuda")
    assert plan_model(prof, devices, None).estimated_step_s > 0


@pytest.mark.parametrize("error", [MemoryError(), MemoryError("a table of 9e12 entries"), RuntimeError("two\nlines"),
                                   ValueError("brute force over 9 assignments exceeds 8")])
def test_a_failed_search_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: Exception) -> None:
    """Whatever the search raises, `parashift plan` says it in one line and exits 1."""
    import parashift.planner.search
    from typer.testing import CliRunner

    from parashift.cli import app

    def fail(*args: object, **kwargs: object) -> Plan:
        raise error

    monkeypatch.setattr(parashift.planner.search, "plan_model", fail)
    path = tmp_path / "g.json"
    path.write_text(json.dumps(GOOD_GRAPH))
    done = CliRunner().invoke(app, ["plan", "specs/default.yaml", "--graph", str(path)])
    assert done.exit_code == 1 and "Traceback" not in done.output, done.output
    assert len(done.output.strip().splitlines()) == 1, done.output
    assert done.output.startswith(f"{path}: cannot plan it: "), done.output
    if not isinstance(error, ValueError):
        assert type(error).__name__ in done.output


def _chain(ops: int) -> dict:
    """`ops` elementwise ops in a line, batch 4."""
    body = [{"name": f"o{i}", "dims": {"b": 4, "f": 8}, "inputs": [["b", "f"]], "output": ["b", "f"], "flops": 10.0}
            for i in range(ops)]
    return {"ops": body, "edges": [{"src": f"o{i}", "dst": f"o{i + 1}"} for i in range(ops - 1)]}


def test_exhaustive_refuses_graphs_past_its_limit_up_front(tmp_path: Path) -> None:
    """Brute force holds one array axis per op (numpy allows 64): 64 ops plan, 65 are refused
    in one line that gives the limit and points at the DP, which plans them."""
    from parashift.planner.dp import BRUTE_FORCE_MAX_OPS
    from typer.testing import CliRunner

    from parashift.cli import app

    runner = CliRunner()
    for ops in (BRUTE_FORCE_MAX_OPS, BRUTE_FORCE_MAX_OPS + 1):
        path = tmp_path / f"chain{ops}.json"
        path.write_text(json.dumps(_chain(ops)))
        args = ["plan", "specs/default.yaml", "--graph", str(path), "-n", "1", "--json"]
        done = runner.invoke(app, [*args, "--exhaustive"])
        if ops == BRUTE_FORCE_MAX_OPS:
            assert done.exit_code == 0, done.output
            continue
        assert done.exit_code == 1 and "Traceback" not in done.output, done.output
        assert done.output.strip() == (f"{path}: --exhaustive enumerates graphs of at most {BRUTE_FORCE_MAX_OPS} ops "
                                       f"and this one has {ops}; plan it without --exhaustive (the DP, the default)")
        assert runner.invoke(app, args).exit_code == 0
        with pytest.raises(ValueError, match=f"at most {BRUTE_FORCE_MAX_OPS} ops"):
            exhaustive_search(profile_graph(load_graph_json(path), "cuda"), 2)


def test_the_spec_can_forbid_sharding_data_parallelism(tmp_path: Path) -> None:
    """Without tensor or pipeline parallelism, a GPT too large to replicate on 8 devices fits
    only sharded over dp: the planner shards it; with `parallelism.shard_data_parallel: false`
    it may not, and says that nothing fits."""
    import yaml
    from typer.testing import CliRunner

    from parashift.cli import app

    data = yaml.safe_load((REPO / "specs" / "default.yaml").read_text())
    data["model"] = {**data["model"], "n_layers": 4, "d_model": 512, "n_heads": 8, "vocab_size": 8192, "seq_len": 64}
    data["resources"] = {**data["resources"], "kind": "cuda", "memory_gb": 0.2}
    plans = {}
    for allowed in (True, False):
        data["parallelism"] = {**data["parallelism"], "max_tp": 1, "max_pp": 1, "shard_data_parallel": allowed,
                               "memory_reserve": 0, "memory_reserve_gb": 0}  # the whole toy device
        spec = tmp_path / f"spec-{allowed}.yaml"
        spec.write_text(yaml.safe_dump(data))
        out = CliRunner().invoke(app, ["plan", str(spec), "--devices", "8", "--json"])
        assert out.exit_code == 0, out.output
        plans[allowed] = Plan.model_validate_json(out.output)
    assert plans[False].dp_shard == 1 and not plans[False].feasible
    assert plans[True].dp_shard == 8 and plans[True].feasible, (plans[True].mesh, plans[True].dp_shard)
    # A run of the plan that does not fit warns (its notes are INFO): the run's summary shows it
    from parashift.tasks.plan import plan_warnings

    (warning,) = plan_warnings(plans[False])
    assert "may run out of memory" in warning and plan_warnings(plans[True]) == []


def test_the_planner_leaves_the_spec_s_reserve_of_each_device_free(tmp_path: Path) -> None:
    """A device whose memory the data-parallel plan fills to 96%: planned to the brim without a
    reserve, and within the device less its reserve (8% by default) with one: another layout."""
    import yaml
    from parashift.specs.models import ParallelismSpec
    from typer.testing import CliRunner

    from parashift.cli import app

    assert ParallelismSpec().plan_memory_bytes(None) is None
    assert ParallelismSpec().plan_memory_bytes(141 * 2**30) == int(141 * 2**30 * 0.92)
    assert ParallelismSpec().plan_memory_bytes(4 * 2**30) == 3 * 2**30  # the 1 GiB floor
    data = yaml.safe_load((REPO / "specs" / "default.yaml").read_text())
    data["model"] = {**data["model"], "n_layers": 4, "d_model": 512, "n_heads": 8, "vocab_size": 8192, "seq_len": 64}

    base = dict(data["parallelism"])

    def plan(memory_gb: float, **reserve: float) -> Plan:
        data["resources"] = {**data["resources"], "kind": "cuda", "memory_gb": memory_gb}
        data["parallelism"] = {**base, "max_pp": 1, "strategy": "auto", **reserve}
        spec = tmp_path / "spec.yaml"
        spec.write_text(yaml.safe_dump(data))
        out = CliRunner().invoke(app, ["plan", str(spec), "--devices", "4", "--json"])
        assert out.exit_code == 0, out.output
        return Plan.model_validate_json(out.output)

    roomy = plan(100.0, memory_reserve=0, memory_reserve_gb=0)
    device_gb = roomy.memory_per_device_bytes / 0.96 / 2**30
    brim = plan(device_gb, memory_reserve=0, memory_reserve_gb=0)
    assert brim.feasible and brim.memory_per_device_bytes > 0.92 * device_gb * 2**30
    reserved = plan(device_gb, memory_reserve_gb=0)
    assert reserved.feasible and reserved.memory_per_device_bytes <= 0.92 * device_gb * 2**30
    assert reserved.memory_per_device_bytes < brim.memory_per_device_bytes  # another layout: less kept per device


def test_a_dense_dag_plans_with_its_bound_and_round_trips_as_json(tmp_path: Path) -> None:
    """bench.planner's dense DAGs (op i reads up to fan_in earlier ops): a valid user graph
    (it survives the JSON a user would write), planned with a lower bound not above its step."""
    from parashift.planner.builders import dense_dag_graph

    g = dense_dag_graph(12, fan_in=4, seed=1)
    assert max(sum(e.dst == op.name for e in g.edges) for op in g.ops) == 4
    path = tmp_path / "dense.json"
    path.write_text(graph_to_json(g))
    assert load_graph_json(path) == g
    plan = plan_model(profile_graph(g, "cuda"), 8)
    assert plan.feasible and plan.lower_bound_s <= plan.estimated_step_s * (1 + 1e-9)
