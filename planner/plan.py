"""The Plan: how one training step is laid out over devices. One home for the type.

A Plan is data, serialisable to JSON, so it travels between Prefect tasks, into checkpoint
manifests and onto workers. The trainer's `parallelize` is the only consumer that acts on it.
"""

from __future__ import annotations

from math import prod

from pydantic import BaseModel, ConfigDict, Field, model_validator

# Mesh axis names, outermost first. "dp" replicates (or FSDP-shards) the model and splits the
# batch, "tp" splits op dimensions, "pp" splits the layer sequence into stages.
MESH_AXES = ("pp", "dp", "tp")


class OpPlacement(BaseModel):
    """One op's configuration: which mesh axes split which of its iteration dimensions."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    op: str
    # iteration dim name -> mesh axes that split it (in order); dims absent here are not split.
    splits: dict[str, tuple[str, ...]] = Field(default_factory=dict)
    # What the planner expects of this op (per step, per device) and how the trainer realises it.
    stage: int = Field(default=0, ge=0, description="pipeline stage holding the op")
    compute_s: float = 0.0
    comm_s: float = Field(default=0.0, description="collectives inside the op, incl. gradient sync")
    memory_bytes: int = Field(default=0, description="parameter state + saved activations per device")
    dtensor: dict[str, tuple[str, ...]] = Field(
        default_factory=dict,
        description="tensor ('in0', 'out', 'param0', ...) -> DTensor placement per mesh axis (dp, tp order)",
    )


class Plan(BaseModel):
    """Device mesh, per-op placements, pipeline stages, and what the planner expects it to cost."""

    model_config = ConfigDict(extra="forbid")

    devices: int = Field(ge=1)
    mesh: dict[str, int] = Field(description="mesh axis name -> size, outermost first; sizes multiply to devices")
    placements: list[OpPlacement] = Field(default_factory=list)
    micro_batches: int = Field(default=1, ge=1)
    estimated_step_s: float | None = None
    memory_per_device_bytes: int | None = None
    strategy: str = Field(default="data-parallel", description="how the plan was chosen")
    baselines: dict[str, float] = Field(default_factory=dict, description="baseline name -> estimated step s")
    baseline_memory_bytes: dict[str, int] = Field(default_factory=dict, description="baseline -> memory per device")
    stages: list[list[str]] = Field(default_factory=list, description="op names per pipeline stage, in order")
    feasible: bool = Field(default=True, description="False when no candidate fits the memory limit")
    notes: list[str] = Field(default_factory=list, description="pruning and search remarks")

    @model_validator(mode="after")
    def _mesh_matches_devices(self) -> Plan:
        unknown = [axis for axis in self.mesh if axis not in MESH_AXES]
        if unknown:
            raise ValueError(f"unknown mesh axes {unknown}; known: {list(MESH_AXES)}")
        if prod(self.mesh.values()) != self.devices:
            raise ValueError(f"mesh {self.mesh} has {prod(self.mesh.values())} devices, plan says {self.devices}")
        return self

    def degree(self, axis: str) -> int:
        """Size of a mesh axis; 1 when the plan does not use it."""
        return self.mesh.get(axis, 1)

    @property
    def is_pure_data_parallel(self) -> bool:
        return self.degree("tp") == 1 and self.degree("pp") == 1

    @classmethod
    def data_parallel(cls, devices: int, **fields: object) -> Plan:
        """Every device holds the whole model and a share of the global batch."""
        return cls(devices=devices, mesh={"dp": devices}, strategy="data-parallel", **fields)
