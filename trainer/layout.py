"""The Layout of a job's whole training state under a Plan, computed without processes.

Every tensor of the state is named by its kind (`trainer.state`): parameters `model/<name>`,
AdamW state `optim/<name>/{exp_avg,exp_avg_sq,step}` and each rank's RNG state
`rng/rank<r>/<device>`. Which rank holds which box follows from the plan and the model's
family alone: the pipeline stage that owns a parameter (`Plan.layers_per_stage`, the family's
sharding table), the dim tensor parallelism shards it along (`ShardingTable.tp_shard_dims`),
and data parallelism replicating it or, sharded (FSDP), cutting each tensor-parallel box along
dim 0 (FSDP2 shards every parameter on dim 0). The same function serves the worker (what to write, what to read), the CLI and the flow (the reshard plan shown
before anything moves).
"""

from __future__ import annotations

from typing import Any

import torch
from parashift.models import family_of
from parashift.ptc import Layout, dtype_name
from parashift.ptc.dtensor import holdings
from parashift.ptc.layout import TensorPlacement, mesh_layout
from parashift.specs.plan import Plan
from parashift.trainer.state import STATE_KINDS, rng_state_bytes

__all__ = ["layout_mismatches", "parameter_placements", "rng_state_bytes", "state_layout"]


def parameter_placements(plan: Plan, model_spec: Any) -> dict[str, TensorPlacement]:
    """Where each parameter of the model a spec's `model:` section describes lives under
    `plan`, by parameter name (built on the meta device: no memory, no processes)."""
    family = family_of(model_spec)
    model = family.build_on_meta(model_spec)
    names = [name for name, _ in model.named_parameters()]
    table = family.sharding
    n_layers = len(list(family.layers(model)))
    sharded = table.tp_shard_dims(names, plan.tp_regions(n_layers)) if table is not None else {}
    stages = plan.layers_per_stage(n_layers)
    fsdp_dim = 0 if plan.dp_shard > 1 else None
    return {name: TensorPlacement(tuple(param.shape), dtype_name(param.dtype),
                                  table.stage_of(name, stages) if table is not None else None,
                                  sharded.get(name), fsdp_dim,
                                  split_dim=0)  # every plan splits dim 0 (docs/plans.md): stored as is
            for name, param in model.named_parameters()}


def state_layout(plan: Plan, model_spec: Any, rng_bytes: dict[str, int] | None = None) -> Layout:
    """Every rank's box of every tensor of the training state under `plan`: each kind of
    state (`trainer.state.STATE_KINDS`) places its tensors from where the parameters live."""
    parameters = parameter_placements(plan, model_spec)
    rng = rng_bytes or rng_state_bytes(torch.device("cpu"))
    placements: dict[str, TensorPlacement] = {}
    for kind in STATE_KINDS:
        placements.update(kind.placements(parameters, plan.devices, rng))
    return mesh_layout(plan.mesh, placements, plan.dp_shard)


def layout_mismatches(layout: Layout, state: dict[str, torch.Tensor], rank: int) -> list[str]:
    """Where the live state of `rank` differs from its Layout (empty: they agree)."""
    expected = layout.boxes_of(rank)
    problems = []
    for name, (shape, dtype, box) in holdings(state).items():
        tensor = layout.tensors.get(name)
        if tensor is None:
            problems.append(f"{name} is not in the layout")
        elif tensor.shape != tuple(shape) or tensor.dtype != dtype or expected.get(name) != box:
            problems.append(f"{name}: live {dtype}{list(shape)} box {box}, layout {tensor.dtype}{list(tensor.shape)} box {expected.get(name)}")
    # Kinds present in `state` must be complete (before the first step there is no optimizer state).
    kinds = {name.split("/", 1)[0] for name in state} - {"rng"}
    problems += [f"{name} is in the layout but not held" for name in sorted(expected)
                 if name.split("/", 1)[0] in kinds and name not in state]
    return problems
