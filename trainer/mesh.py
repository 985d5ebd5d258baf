"""ParallelDims: the Plan's degrees checked against the world size and the model, and the one
place that builds device meshes (after torchtitan's ParallelDims).

`plan_refusals` runs before any process group exists (the worker calls it first; launchers and
tasks can call it before starting processes), so a plan the trainer cannot execute fails with a
reason instead of a crash inside a collective.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from planner.plan import MESH_AXES, Plan
from specs import JobSpec


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of the ("pp", "dp", "tp") mesh, outermost first (the Plan's axis order)."""

    pp: int
    dp: int
    tp: int

    @classmethod
    def from_plan(cls, plan: Plan) -> ParallelDims:
        return cls(pp=plan.degree("pp"), dp=plan.degree("dp"), tp=plan.degree("tp"))

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def pure_data_parallel(self) -> bool:
        """DDP over every rank, no mesh: the trainer's original (and fastest-to-start) path."""
        return self.pp == 1 and self.tp == 1

    def validate(self, world_size: int) -> None:
        if self.world_size != world_size:
            raise ValueError(f"mesh pp{self.pp} x dp{self.dp} x tp{self.tp} needs {self.world_size} devices, got {world_size}")

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The 3-D ("pp", "dp", "tp") mesh; axes of size 1 are kept so names always resolve.
        Sub-meshes by name: `mesh["tp"]`, `mesh["dp"]`, `mesh["pp"]`."""
        self.validate(dist.get_world_size())
        return init_device_mesh(device_type, (self.pp, self.dp, self.tp), mesh_dim_names=MESH_AXES)


@dataclass(frozen=True)
class Coordinates:
    """This rank's place on each mesh axis."""

    pp_rank: int
    dp_rank: int
    tp_rank: int

    @classmethod
    def of(cls, mesh: DeviceMesh | None) -> Coordinates:
        if mesh is None:
            return cls(0, 0, 0)
        coord = mesh.get_coordinate()
        assert coord is not None, "this rank is not in the mesh"
        return cls(*coord)


def job_plan_refusals(plan: Plan, spec: JobSpec) -> list[str]:
    """`plan_refusals` for the model and batch of a job spec."""
    m = spec.model
    return plan_refusals(plan, n_layers=m.n_layers, n_heads=m.n_heads, seq_len=m.seq_len, global_batch=spec.training.global_batch)


def plan_refusals(plan: Plan, *, n_layers: int, n_heads: int, seq_len: int, global_batch: int) -> list[str]:
    """Why this plan cannot run on this model and batch (empty: it can). No processes needed."""
    from trainer.parallel import executable_plan, plan_to_tp  # the one Plan -> module mapping lives there

    plan = executable_plan(plan)
    dims = ParallelDims.from_plan(plan)
    reasons: list[str] = []
    if dims.tp > 1:
        choices, problems = plan_to_tp(plan, n_layers)
        reasons += problems
        if choices.attention and n_heads % dims.tp:
            reasons.append(f"tensor-parallel attention needs n_heads ({n_heads}) divisible by tp ({dims.tp})")
        if choices.sequence and seq_len % dims.tp:
            reasons.append(f"sequence parallelism needs seq_len ({seq_len}) divisible by tp ({dims.tp}) (DTensor cannot shard an uneven sequence)")
    if global_batch < dims.dp:
        reasons.append(f"global batch {global_batch} is smaller than the data-parallel degree {dims.dp}")
    if dims.pp > 1:
        from trainer.pipeline import stage_layers

        try:
            stage_layers(plan, n_layers)
        except ValueError as error:
            reasons.append(str(error))
        if plan.micro_batches < dims.pp:
            reasons.append(f"a pipeline of {dims.pp} stages needs at least {dims.pp} micro-batches (the plan has "
                           f"{plan.micro_batches})")
        base, extra = divmod(global_batch, dims.dp)
        for share in {base, base + 1} if extra else {base}:
            if share % plan.micro_batches:
                reasons.append(
                    f"a data-parallel share of {share} samples does not split into {plan.micro_batches} equal "
                    "pipeline micro-batches (pipelining needs equal micro-batch shapes)"
                )
    return reasons
