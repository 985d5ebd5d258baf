"""ParallelDims: the Plan's degrees checked against the world size and the model, and the one
place that builds device meshes (after torchtitan's ParallelDims).

Every plan runs on a mesh, pure data parallelism included (a mesh whose only axis of size > 1
is dp). The dp axis is two axes underneath, ("dp_replicate", "dp_shard"), flattened back into
"dp": the training state is replicated over the first and sharded (FSDP) over the second, so
data parallelism, FSDP and HSDP are three sizes of one mesh.

Whether a plan can run a job's model at all is asked before any process group exists, by the
worker first and by launchers and tasks before they start processes (`models.plans`), so a plan
the trainer cannot execute fails with a reason instead of a crash inside a collective.
"""

from __future__ import annotations

import functools
import gc
import sys
from dataclasses import dataclass

import torch.distributed as dist
from parashift.specs.plan import Plan
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

# The mesh as built: dp split into its replicate and shard parts (rank order is unchanged:
# dp = dp_replicate * dp_shard + dp_shard index, as the Plan's ("pp", "dp", "tp") order reads it).
BUILT_AXES = ("pp", "dp_replicate", "dp_shard", "tp")


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of the mesh, outermost first; dp = dp_replicate x dp_shard."""

    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int

    @classmethod
    def from_plan(cls, plan: Plan) -> ParallelDims:
        return cls(pp=plan.degree("pp"), dp_replicate=plan.dp_replicate, dp_shard=plan.dp_shard, tp=plan.degree("tp"))

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    def validate(self, world_size: int) -> None:
        if self.world_size != world_size:
            raise ValueError(f"mesh pp{self.pp} x dp{self.dp} x tp{self.tp} needs {self.world_size} devices, got {world_size}")

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The ("pp", "dp_replicate", "dp_shard", "tp") mesh with "dp" flattened from its two
        parts (`data_mesh`); axes of size 1 are kept so names always resolve: `mesh["tp"]`,
        `mesh["dp_shard"]`, `mesh["dp_replicate", "dp_shard"]`, `mesh["pp"]`."""
        self.validate(dist.get_world_size())
        mesh = init_device_mesh(device_type, (self.pp, self.dp_replicate, self.dp_shard, self.tp), mesh_dim_names=BUILT_AXES)
        data_mesh(mesh)
        return mesh


def data_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The whole data axis, "dp", as one 1-D mesh: flattened from its two parts (torch's way to
    name a product of axes; the same mesh each call). Not `mesh["dp"]`: torch 2.13 warns on
    every slice of a flattened axis from the root mesh, a warning per rank in each run's log."""
    return mesh["dp_replicate", "dp_shard"]._flatten("dp")


def forget_meshes() -> None:
    """Drop what torch.distributed cached about the meshes of a job that has ended, in a process
    that goes on to the next job (a warm worker). DTensor's sharding propagation and
    redistribution caches keep every mesh they saw, and each mesh its gloo groups: 3 threads
    per group, never joined, waking in every collective the process runs after. One shape of
    mesh after another, a warm worker had 90 threads after 6 jobs and 420 after a test run,
    and spent 4-15% of a core while idle. These are caches only: the next job refills them.

    torch has no public call for this (`tensor.debug._clear_sharding_prop_cache` clears two of
    them), so every lru_cache of torch.distributed is cleared too: those its modules and
    classes hold, and those made since the imports (the only ones `gc` lists once a warm
    worker has frozen its imports)."""
    from torch.distributed.tensor import _redistribute
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()  # the Python one (this thread's) and the C++ fast path's
    _redistribute.clear_redistribute_planner_cache()
    for cached in [*_held_by_modules("torch.distributed"), *gc.get_objects()]:
        if type(cached) is functools._lru_cache_wrapper and cached.__module__.startswith("torch.distributed"):
            cached.cache_clear()


def release_leftover_groups() -> None:
    """Let go of the process groups of every mesh still alive once a job's objects are collected
    (call after `forget_meshes` and `gc.collect()`).

    Why: when a warm rank's all-reduce on the world group fails (a peer died during the gradient
    clipping's; each of the 6 such failures traced), torch keeps the job's root mesh alive from
    outside Python's reach: no tracked object refers to it (`gc.get_referrers`, after
    `gc.unfreeze()`), and what does is not found. The mesh keeps its groups (`_pg_registry`,
    torch 2.13), the world group among them: 12 threads, and an open connection to each
    surviving peer. A peer still in that all-reduce then never saw this rank leave, and waited
    out its launcher's 5 s grace. Emptying the leftover meshes' registries drops the last
    references to their groups: the connections close, the waiting peer's all-reduce fails at
    once, and the threads end."""
    for leftover in gc.get_objects():
        if isinstance(leftover, DeviceMesh):
            leftover._pg_registry.clear()
            leftover._flatten_mapping.clear()  # its flattened meshes hold the same groups


def _held_by_modules(prefix: str) -> list[object]:
    """Everything that modules named `prefix...` and their own classes hold at top level (the
    caller picks the caches out of it)."""
    found: list[object] = []
    for name, module in list(sys.modules.items()):
        if not name.startswith(prefix) or module is None:
            continue
        for value in list(vars(module).values()):
            found.append(value)
            if issubclass(type(value), type) and value.__module__ == name:  # a class of its own
                found += [v.__func__ if type(v) in (staticmethod, classmethod) else v for v in vars(value).values()]
    return found


@dataclass(frozen=True)
class Coordinates:
    """This rank's place on each mesh axis."""

    pp_rank: int
    dp_replicate_rank: int
    dp_shard_rank: int
    tp_rank: int
    dp_shard: int

    @classmethod
    def of(cls, mesh: DeviceMesh, dims: ParallelDims) -> Coordinates:
        coord = mesh.get_coordinate()
        assert coord is not None, "this rank is not in the mesh"
        return cls(*coord, dp_shard=dims.dp_shard)

    @property
    def dp_rank(self) -> int:
        return self.dp_replicate_rank * self.dp_shard + self.dp_shard_rank

    def within_stage(self) -> dict[str, int]:
        """Coordinates on the axes a pipeline stage's tensors may be replicated or split over."""
        return {"dp_replicate": self.dp_replicate_rank, "dp_shard": self.dp_shard_rank, "tp": self.tp_rank}
