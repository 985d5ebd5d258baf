"""The cost model's estimate of one given plan (not a search): what a pinned plan costs, and
what bench/memory_truth.py compares with the trainer's measured peak.

Covers plans whose tp axis runs Megatron's layout (every op splits its `tp_dim`, the residual
stream its sequence dim where the op allows it) or is absent, with the data axis replicated or
fully sharded (FSDP), `micro_batches` equal micro-batches, and pipeline stages cut at the
plan's layers (`Plan.layers_per_stage`), each costed as the search costs a stage (1F1B's
in-flight micro-batches, `Weights.schedule`).
"""

from __future__ import annotations

from parashift.planner.checkpointing import checkpointed, policy_on, with_precision
from parashift.planner.configs import named_mesh
from parashift.planner.costs import CostModel
from parashift.planner.graph import Graph
from parashift.planner.pipeline import block_order, stage_ops
from parashift.planner.problem import Weights
from parashift.planner.profile import ModelProfile
from parashift.planner.stage import StageResult, stage_result
from parashift.specs.plan import Plan


def _megatron_assign(graph: Graph, costs: CostModel) -> list[int]:
    """Per op, the configuration splitting the batch over "dp" and, over "tp", its `tp_dim`
    (else the one dim of `tp_dims` it may split: the sequence of norms and residual adds)."""
    mesh = costs.mesh
    assign = []
    for op in graph.ops:
        tp_dim = op.tp_dim or (op.tp_dims[0] if op.tp_dims and len(op.tp_dims) == 1 else None)
        want = [graph.batch_dim if name == "dp" else tp_dim for name in mesh.names]
        target = tuple(tuple(a for a, w in enumerate(want) if w == d) for d in op.dims)
        match = [i for i, c in enumerate(costs.op_cost(op).configs) if c.axes == target]
        if not match:
            raise ValueError(f"op {op.name}: no configuration splits {dict(zip(mesh.names, want, strict=True))}")
        assign.append(match[0])
    return assign


def estimate(profile: ModelProfile, plan: Plan, mixed_precision: str | None = None,
             stage: int | None = None) -> StageResult:
    """Step time and per-device memory of `plan` under the cost model (`.time_s`,
    `.memory_bytes`, per-op `.rows`). A pipelined plan: pipeline stage `stage`'s devices (by
    default the stage that needs the most memory; its `.time_s` is that stage's, not the
    pipeline's step). ValueError for an HSDP plan."""
    if 1 < plan.dp_shard < plan.degree("dp"):
        raise ValueError("estimate covers plans with the data axis replicated or fully sharded")
    policy = policy_on(mixed_precision, plan.degree("dp"))
    base = profile.graph if policy is None else with_precision(profile.graph, policy)
    m, pp = plan.micro_batches, plan.degree("pp")
    mesh = named_mesh(plan.degree("dp"), plan.degree("tp"), profile.comm.devices_per_node, base.batch_dim,
                      shard_dp=plan.dp_shard > 1)
    weights = Weights.schedule(pp, m, plan.reshard_after_forward)
    by_mode: dict[str, tuple[Graph, CostModel]] = {}

    def costed(mode: str) -> tuple[Graph, CostModel]:
        """The whole graph as `mode` checkpoints it, at the micro-batch size, with its costs."""
        if mode not in by_mode:
            graph = checkpointed(base, mode)
            if m > 1:
                size = graph.ops[0].dims[graph.batch_dim] // m
                graph = graph.model_copy(update={"ops": [graph.op_with_batch(op, size) for op in graph.ops]})
            by_mode[mode] = graph, CostModel(graph, profile.device, profile.comm, mesh)
        return by_mode[mode]

    if pp == 1:
        graph, costs = costed(plan.ac_of_stage(0))
        return stage_result(graph, costs, _megatron_assign(graph, costs), weights, 0.0)
    graph, _ = costed(plan.ac_of_stage(0))
    blocks = block_order(graph)
    counts = [len(layers) for layers in plan.layers_per_stage(len(blocks))]
    results = []
    for s, names in enumerate(stage_ops(graph, blocks, counts)):
        whole, _ = costed(plan.ac_of_stage(s))
        sub = whole.subgraph(names)  # its own layers: a stage recomputes one of them at a time
        costs = CostModel(sub, profile.device, profile.comm, mesh)
        results.append(stage_result(sub, costs, _megatron_assign(sub, costs), weights.of_stage(s, pp, m), 0.0))
    return results[stage] if stage is not None else max(results, key=lambda r: r.memory_bytes)
