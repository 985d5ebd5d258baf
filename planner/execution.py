"""From the planner's per-op choice to what the trainer executes (the Plan's contract part).

The search picks a configuration per op of its graph; the trainer applies whole module styles
(Megatron attention or MLP per layer, sequence parallelism, a vocab-parallel embedding and
head). Each op of a GPT graph says which part of the model it is (`Op.part`, `Op.layer`,
written by `planner.builders.gpt_graph`), so this is the one place that reads the per-op
splits and the one that knows which ops make up a part. The trainer reads only the result.

Rules (what the trainer implements over "tp"):

    embed        splits v          vocab-parallel embedding
    sequence     splits s          sequence parallelism: every norm and residual add, or none
    attention    splits h          per layer, all of qkv, attn, proj or none of them
    mlp          splits f          per layer, fc1 and fc2 both or neither
    head, loss   split v           vocab-parallel head; the loss only with the head

A plan whose every op splits only the batch over "tp" is data parallelism over dp x tp and
becomes that mesh. Splits over "dp" of anything but the batch are not executed.
"""

from __future__ import annotations

from parashift.planner.graph import Graph, Op
from parashift.specs.plan import Plan, TensorParallel

# The iteration dim each part splits over "tp".
TP_DIM = {"embed": "v", "sequence": "s", "attention": "h", "mlp": "f", "head": "v", "loss": "v"}


def _on(splits: dict[str, tuple[str, ...]], axis: str) -> set[str]:
    return {dim for dim, axes in splits.items() if axis in axes}


def executable(plan: Plan, graph: Graph) -> Plan:
    """`plan` with its contract part derived from its placements over `graph`: mesh (batch-only
    tp as dp), `tensor_parallel`, `stage_layers`; reasons the trainer cannot run it, if any, in
    `trainer_refusals`. A plan without placements is returned as it is."""
    if not plan.placements:
        return plan
    if any(op.part is None for op in graph.ops):
        return plan.model_copy(update={"trainer_refusals": [
            f"graph {graph.name!r} is not a model the trainer runs (its ops do not name trainer parts)"]})
    plan = _batch_only_tp_as_dp(plan)
    ops = {op.name: op for op in graph.ops}
    problems: list[str] = []
    update: dict[str, object] = {}
    if plan.degree("tp") > 1:
        update["tensor_parallel"] = _tensor_parallel(plan, ops, problems)
    if plan.degree("pp") > 1 and plan.stages:
        update["stage_layers"] = _stage_layers(plan.stages, ops, problems)
    for p in plan.placements:
        extra = sorted(_on(p.splits, "dp") - {graph.batch_dim})
        if extra:
            problems.append(f"op {p.op} splits {extra} over dp; the trainer's dp axis splits only the batch")
    if problems:
        update = {"trainer_refusals": problems}
    return Plan.model_validate({**plan.model_dump(), **update})


def _batch_only_tp_as_dp(plan: Plan) -> Plan:
    """When every op splits only the batch over "tp" (the planner's choice for small models),
    "tp" is more data parallelism: the mesh becomes pp x (dp * tp), in the same rank order (batch
    splits nest in mesh order either way)."""
    tp = plan.degree("tp")
    if tp == 1 or not all(_on(p.splits, "tp") == {"b"} for p in plan.placements):
        return plan
    mesh = {"pp": plan.degree("pp"), "dp": plan.degree("dp") * tp}
    placements = [p.model_copy(update={"splits": {d: tuple(dict.fromkeys("dp" if a == "tp" else a for a in axes))
                                                  for d, axes in p.splits.items()}}) for p in plan.placements]
    return plan.model_copy(update={"mesh": {k: n for k, n in mesh.items() if n > 1}, "placements": placements,
                                   "notes": [*plan.notes, f"tp {tp} splits only the batch: run as data parallelism"]})


def _tensor_parallel(plan: Plan, ops: dict[str, Op], problems: list[str]) -> TensorParallel:
    """The per-op splits over "tp" as the trainer's regions; what breaks a rule goes to `problems`."""
    on: dict[tuple[str, int | None], list[bool]] = {}
    for p in plan.placements:
        op = ops.get(p.op)
        if op is None:
            problems.append(f"op {p.op} is not in the graph")
            continue
        assert op.part is not None  # checked by `executable`
        dims = _on(p.splits, "tp")
        want = TP_DIM[op.part]
        if dims - {want}:
            problems.append(f"op {p.op} splits {sorted(dims - {want})} over tp; the trainer implements {[want]}")
        key = (op.part, None if op.part == "sequence" else op.layer)
        on.setdefault(key, []).append(want in dims)

    def region(part: str, layer: int | None = None) -> bool:
        flags = on.get((part, layer), [])
        if any(flags) and not all(flags):
            where = "every norm and residual add" if part == "sequence" else f"layer {layer}'s {part} ops"
            problems.append(f"{where} must split {TP_DIM[part]} over tp together, or none of them")
        return bool(flags) and all(flags)

    layers = sorted({layer for part, layer in on if part in ("attention", "mlp") and layer is not None})
    head, loss = region("head"), region("loss")
    if loss and not head:
        problems.append("the loss splits the vocabulary over tp but the head does not")
    return TensorParallel(
        sequence=region("sequence"), embed=region("embed"),
        attention=tuple(i for i in layers if region("attention", i)),
        mlp=tuple(i for i in layers if region("mlp", i)),
        head=head, loss_parallel=loss and head and plan.degree("pp") == 1,
    )


def _stage_layers(stages: list[list[str]], ops: dict[str, Op], problems: list[str]) -> list[list[int]]:
    """Layers held by each stage's ops; the embedding must be on the first, the head on the last."""
    layers = [sorted({ops[n].layer for n in names if n in ops and ops[n].layer is not None}) for names in stages]  # type: ignore[misc]
    parts = [{ops[n].part for n in names if n in ops} for names in stages]
    if any("embed" in p for p in parts[1:]) or any("head" in p for p in parts[:-1]):
        problems.append("the embedding must sit on the first pipeline stage and the head on the last")
    flat = [i for stage in layers for i in stage]
    if any(not stage for stage in layers) or flat != list(range(len(flat))):
        problems.append(f"pipeline stages must hold contiguous, non-empty runs of layers; got {layers}")
        return []
    return layers
