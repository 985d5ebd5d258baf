"""The Layout of a job's whole training state under a Plan, computed without processes.

Every tensor of the state is named: parameters `model/<name>`, AdamW state
`optim/<name>/{exp_avg,exp_avg_sq,step}` and each rank's RNG state `rng/rank<r>/<device>`.
Which rank holds which box follows from the plan and the model's family alone: the pipeline
stage that owns a parameter (`Plan.layers_per_stage`, the family's sharding table), the dim
tensor parallelism shards it along (`ShardingTable.tp_shard_dims`), and data parallelism
replicating it or, sharded (FSDP),
cutting each tensor-parallel box along dim 0 (FSDP2 shards every parameter on dim 0). The same function
serves the worker (what to write, what to read), the CLI and the flow (the reshard plan shown
before anything moves).
"""

from __future__ import annotations

from typing import Any

import torch

from models import family_of
from ptc import Layout, dtype_name
from ptc.dtensor import holdings
from ptc.layout import TensorPlacement, mesh_layout
from specs.plan import Plan

# AdamW's per-parameter state: two moments shaped and placed like the parameter, and a scalar
# float32 step count (torch.optim.AdamW without `capturable`).
MOMENTS = ("exp_avg", "exp_avg_sq")


def rng_state_bytes(device: torch.device) -> dict[str, int]:
    """Bytes of each generator state a rank saves: the CPU one always, the CUDA one on GPUs
    (the live size where a GPU is present; else its Philox seed and offset, 16 bytes)."""
    sizes = {"cpu": torch.get_rng_state().numel()}
    if device.type == "cuda":
        sizes["cuda"] = torch.cuda.get_rng_state(device).numel() if torch.cuda.is_available() else 16
    return sizes


def state_layout(plan: Plan, model_spec: Any, rng_bytes: dict[str, int] | None = None) -> Layout:
    """Every rank's box of every tensor of the training state under `plan`, for the model a
    spec's `model:` section describes (built on the meta device: no memory, no processes)."""
    family = family_of(model_spec)
    with torch.device("meta"):
        model = family.build(model_spec)
    names = [name for name, _ in model.named_parameters()]
    table = family.sharding
    n_layers = len(list(family.layers(model)))
    sharded = table.tp_shard_dims(names, plan.tp_regions(n_layers)) if table is not None else {}
    stages = plan.layers_per_stage(n_layers)
    fsdp_dim = 0 if plan.dp_shard > 1 else None
    placements: dict[str, TensorPlacement] = {}
    for name, param in model.named_parameters():
        stage = table.stage_of(name, stages) if table is not None else None
        where = TensorPlacement(tuple(param.shape), dtype_name(param.dtype), stage, sharded.get(name), fsdp_dim,
                                split_dim=0)  # every plan splits dim 0 (docs/plans.md): stored as is
        placements[f"model/{name}"] = where
        for moment in MOMENTS:
            placements[f"optim/{name}/{moment}"] = where
        placements[f"optim/{name}/step"] = TensorPlacement((), "float32", stage)
    for rank in range(plan.devices):
        for device, size in (rng_bytes or rng_state_bytes(torch.device("cpu"))).items():
            placements[f"rng/rank{rank:05d}/{device}"] = TensorPlacement((size,), "uint8", rank=rank)
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
