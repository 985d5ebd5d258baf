"""The Plan: how one training step is laid out over devices. The contract between the planner,
which writes it, and the trainer, which executes it: one home, imported by both.

A Plan is data, serialisable to JSON, so it travels between Prefect tasks, into checkpoint
manifests and onto workers. Two parts:

- **what the trainer executes**, in the trainer's own terms and validated here once: the mesh
  (pp x dp x tp), which parts of the model the "tp" axis splits (`TensorParallel`), the layers
  of each pipeline stage, micro-batches, and whether the "dp" axis replicates the training
  state or shards it (FSDP; HSDP over a 2-D dp mesh);
- **the planner's annotation**: per-op placements of its graph, estimates, baselines, notes.
  The trainer never reads op names; the planner translates its per-op choice into the first
  part (`planner.execution`).

It lives in `specs` because both sides already import the spec language and neither may import
the other.
"""

from __future__ import annotations

from math import prod
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# Mesh axis names, outermost first. "dp" replicates (or shards) the training state and splits
# the batch, "tp" splits op dimensions, "pp" splits the layer sequence into stages.
MESH_AXES = ("pp", "dp", "tp")

# Activation checkpointing of each decoder layer (trainer.parallel `apply_ac`): "none" keeps every
# activation backward needs; "selective" keeps the outputs of matmuls, attention and collectives
# and recomputes the rest (torchtitan's per-op policy); "full" keeps each layer's input only and
# recomputes the whole layer in backward.
ActivationCheckpointing = Literal["none", "selective", "full"]
AC_MODES: tuple[str, ...] = ("none", "selective", "full")
# How bf16 compute is had (with `precision: bf16`): "autocast" over fp32 parameters, or FSDP2's
# MixedPrecisionPolicy (bf16 parameters gathered and computed with, gradients reduced in fp32,
# fp32 master weights and optimizer state), which needs a data-parallel axis to hold it.
MixedPrecision = Literal["autocast", "fsdp"]


class TensorParallel(BaseModel):
    """Which parts of the GPT the "tp" axis splits; everything else is replicated over tp.

    Per layer: attention (Megatron: q, k, v column-parallel by heads, the output projection
    row-parallel) and the MLP (up column-parallel, down row-parallel). Across the model: the
    residual stream and norms on the sequence (sequence parallelism), the embedding and the head
    on the vocabulary, and the loss on vocabulary-sharded logits (`loss_parallel`).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    sequence: bool = False
    embed: bool = False
    attention: tuple[int, ...] = Field(default=(), description="layers whose attention is tensor parallel")
    mlp: tuple[int, ...] = Field(default=(), description="layers whose MLP is tensor parallel")
    head: bool = False
    loss_parallel: bool = Field(default=False, description="cross entropy on vocab-sharded logits (needs head)")

    @model_validator(mode="after")
    def _consistent(self) -> TensorParallel:
        for name in ("attention", "mlp"):
            layers = getattr(self, name)
            if list(layers) != sorted(set(layers)) or any(i < 0 for i in layers):
                raise ValueError(f"{name} layers must be distinct, ascending and >= 0; got {list(layers)}")
        if self.loss_parallel and not self.head:
            raise ValueError("loss_parallel needs the head split over tp (head: true)")
        return self

    @classmethod
    def megatron(cls, n_layers: int, pipelined: bool = False) -> TensorParallel:
        """Everything split (torchtitan's default); the loss stays whole on a pipeline stage,
        where the schedule computes it outside `loss_parallel`."""
        layers = tuple(range(n_layers))
        return cls(sequence=True, embed=True, attention=layers, mlp=layers, head=True, loss_parallel=not pipelined)


class OpPlacement(BaseModel):
    """One op's configuration: which mesh axes split which of its iteration dimensions."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    op: str
    # iteration dim name -> mesh axes that split it (in order); dims absent here are not split.
    splits: dict[str, tuple[str, ...]] = Field(default_factory=dict)
    # What the planner expects of this op (per step, per device) and how the trainer realises it.
    stage: int = Field(default=0, ge=0, description="pipeline stage holding the op")
    compute_s: float = Field(default=0.0, description="forward and backward, and the optimizer's update of its parameters")
    comm_s: float = Field(default=0.0, description="collectives inside the op, incl. gradient sync")
    memory_bytes: int = Field(default=0, description="parameter state + saved activations per device")
    dtensor: dict[str, tuple[str, ...]] = Field(
        default_factory=dict,
        description="tensor ('in0', 'out', 'param0', ...) -> DTensor placement per mesh axis (dp, tp order)",
    )


class Plan(BaseModel):
    """Device mesh and what the trainer executes on it, with the planner's annotation."""

    model_config = ConfigDict(extra="forbid")

    # -- what the trainer executes --
    devices: int = Field(ge=1)
    mesh: dict[str, int] = Field(description="mesh axis name -> size, outermost first; sizes multiply to devices")
    tensor_parallel: TensorParallel | None = Field(
        default=None, description="what the tp axis splits; None with tp > 1: everything (TensorParallel.megatron)")
    stage_layers: list[list[int]] = Field(
        default_factory=list, description="layer indices per pipeline stage, in order; empty: balanced")
    micro_batches: int = Field(default=1, ge=1)
    dp_shard: int = Field(
        default=1, ge=1,
        description="ranks of the dp axis that shard parameters, gradients and optimizer state (FSDP): 1 "
                    "replicates them on every dp rank; dp shards them over all (FSDP); in between, HSDP: "
                    "dp / dp_shard replicas, each sharded over dp_shard ranks")
    reshard_after_forward: bool = Field(
        default=True, description="sharded dp: free gathered parameters after forward (gather again in backward)")
    activation_checkpointing: ActivationCheckpointing = Field(
        default="none", description="what each decoder layer keeps for backward: everything (none), matmul, "
                                    "attention and collective outputs (selective), or its input only (full)")
    stage_activation_checkpointing: list[ActivationCheckpointing] = Field(
        default_factory=list, description="per pipeline stage, where the stages differ (the first stage holds the "
                                          "most micro-batches in flight under 1F1B); empty: every stage runs "
                                          "activation_checkpointing")
    mixed_precision: MixedPrecision = Field(
        default="autocast", description="with bf16 compute: autocast over fp32 parameters, or FSDP2's policy "
                                        "(bf16 parameters, fp32 gradient reduction and master state)")
    # -- the planner's annotation --
    placements: list[OpPlacement] = Field(default_factory=list)
    estimated_step_s: float | None = None
    device_peak_flops: float | None = Field(
        default=None, description="the device's GEMM rate the profile measured (FLOP/s): MFU's peak where no "
                                  "table names the device (CPUs)")
    memory_per_device_bytes: int | None = None
    strategy: str = Field(default="data-parallel", description="how the plan was chosen")
    baselines: dict[str, float] = Field(default_factory=dict, description="baseline name -> estimated step s")
    baseline_memory_bytes: dict[str, int] = Field(default_factory=dict, description="baseline -> memory per device")
    stages: list[list[str]] = Field(default_factory=list, description="op names per pipeline stage, in order")
    feasible: bool = Field(default=True, description="False when no candidate fits the memory limit")
    proven_optimal: bool | None = Field(
        default=None, description="the planner proved no fitting plan is faster under its cost model (None: not "
                                  "searched, or nothing fits)")
    lower_bound_s: float | None = Field(
        default=None, description="a proven lower bound on the step time of every fitting plan (the estimate "
                                  "itself when proven optimal)")
    trainer_refusals: list[str] = Field(
        default_factory=list, description="why the trainer cannot execute the per-op placements (empty: it can)")
    notes: list[str] = Field(default_factory=list, description="pruning and search remarks")

    @model_validator(mode="after")
    def _executable_shape(self) -> Plan:
        unknown = [axis for axis in self.mesh if axis not in MESH_AXES]
        if unknown:
            raise ValueError(f"unknown mesh axes {unknown}; known: {list(MESH_AXES)}")
        if prod(self.mesh.values()) != self.devices:
            raise ValueError(f"mesh {self.mesh} has {prod(self.mesh.values())} devices, plan says {self.devices}")
        if self.tensor_parallel is not None and self.degree("tp") == 1:
            raise ValueError("tensor_parallel is given but the mesh has no tp axis")
        if self.degree("dp") % self.dp_shard:
            raise ValueError(f"dp_shard {self.dp_shard} must divide the dp degree {self.degree('dp')}")
        if self.stage_layers:
            if len(self.stage_layers) != self.degree("pp"):
                raise ValueError(f"{len(self.stage_layers)} stage layer lists for a pp degree of {self.degree('pp')}")
            flat = [i for stage in self.stage_layers for i in stage]
            if any(not stage for stage in self.stage_layers) or flat != list(range(len(flat))):
                raise ValueError(f"pipeline stages must hold contiguous, non-empty runs of layers from 0; got {self.stage_layers}")
        if self.stage_activation_checkpointing and len(self.stage_activation_checkpointing) != self.degree("pp"):
            raise ValueError(f"{len(self.stage_activation_checkpointing)} stage checkpointing modes for a pp degree "
                             f"of {self.degree('pp')}")
        return self

    def ac_of_stage(self, stage: int) -> str:
        """The activation checkpointing pipeline stage `stage` runs."""
        return self.stage_activation_checkpointing[stage] if self.stage_activation_checkpointing \
            else self.activation_checkpointing

    def describe(self) -> str:
        """What a segment runs, in one line: `dp 2 x tp 2, FSDP over 2, selective AC, 2 micro-batches`."""
        parts = [" x ".join(f"{axis} {n}" for axis, n in self.mesh.items()) or "1 device"]  # {}: one process
        if self.dp_shard > 1:
            parts.append(f"FSDP over {self.dp_shard}")
        if self.stage_activation_checkpointing:
            parts.append("AC per stage " + "/".join(self.stage_activation_checkpointing))
        elif self.activation_checkpointing != "none":
            parts.append(f"{self.activation_checkpointing} AC")
        if self.mixed_precision == "fsdp" and self.degree("dp") > 1:
            parts.append("bf16 parameters")
        if self.micro_batches > 1:
            parts.append(f"{self.micro_batches} micro-batches")
        return ", ".join(parts)

    def degree(self, axis: str) -> int:
        """Size of a mesh axis; 1 when the plan does not use it."""
        return self.mesh.get(axis, 1)

    @property
    def dp_replicate(self) -> int:
        """Replicas of the training state on the dp axis (dp / dp_shard)."""
        return self.degree("dp") // self.dp_shard

    def tp_regions(self, n_layers: int) -> TensorParallel:
        """What "tp" splits in a model of `n_layers` (nothing without a tp axis)."""
        if self.degree("tp") == 1:
            return TensorParallel()
        if self.tensor_parallel is None:
            return TensorParallel.megatron(n_layers, pipelined=self.degree("pp") > 1)
        return self.tensor_parallel

    def layers_per_stage(self, n_layers: int) -> list[list[int]]:
        """Layer indices of each pipeline stage: the plan's, or balanced. ValueError when they
        do not cover exactly the model's layers."""
        pp = self.degree("pp")
        if self.stage_layers:
            if sum(len(s) for s in self.stage_layers) != n_layers:
                raise ValueError(f"pipeline stages hold layers {self.stage_layers}; the model has {n_layers}")
            return [list(s) for s in self.stage_layers]
        base, extra = divmod(n_layers, pp)
        counts = [base + (1 if s < extra else 0) for s in range(pp)]
        if min(counts) < 1:
            raise ValueError(f"{n_layers} layers cannot fill {pp} pipeline stages")
        starts = [sum(counts[:s]) for s in range(pp)]
        return [list(range(a, a + n)) for a, n in zip(starts, counts, strict=True)]

    @classmethod
    def data_parallel(cls, devices: int, **fields: object) -> Plan:
        """Every device holds the whole model and a share of the global batch."""
        return cls(devices=devices, mesh={"dp": devices}, strategy="data-parallel", **fields)

    @classmethod
    def fully_sharded(cls, devices: int, **fields: object) -> Plan:
        """FSDP (ZeRO-3): every device a share of the batch and of the training state."""
        return cls(devices=devices, mesh={"dp": devices}, dp_shard=devices, strategy="fsdp", **fields)


def plan_refusals(plan: Plan, *, n_layers: int, n_heads: int, seq_len: int, global_batch: int,
                  n_kv_heads: int | None = None) -> list[str]:
    """Why this plan cannot run on this model and batch (empty: it can): what any family's layers,
    heads and batch allow. No processes, no torch (a pinned plan is checked where the spec is read);
    a family adds its own reasons (`models.plans.job_plan_refusals`)."""
    reasons = list(plan.trainer_refusals)
    tp, dp, pp = plan.degree("tp"), plan.degree("dp"), plan.degree("pp")
    if tp > 1:
        regions = plan.tp_regions(n_layers)
        beyond = sorted(i for i in {*regions.attention, *regions.mlp} if i >= n_layers)
        if beyond:
            reasons.append(f"tensor-parallel layers {beyond} do not exist in a model of {n_layers} layers")
        if regions.attention and n_heads % tp:
            reasons.append(f"tensor-parallel attention needs n_heads ({n_heads}) divisible by tp ({tp})")
        elif regions.attention and n_kv_heads is not None and n_kv_heads % tp:
            reasons.append(f"tensor-parallel attention splits the key/value heads: n_kv_heads ({n_kv_heads}) must be "
                           f"divisible by tp ({tp}) (grouped-query attention keeps each query head with its kv head)")
        if regions.sequence and seq_len % tp:
            reasons.append(f"sequence parallelism needs seq_len ({seq_len}) divisible by tp ({tp}) (DTensor cannot shard an uneven sequence)")
    if global_batch < dp:
        reasons.append(f"global batch {global_batch} is smaller than the data-parallel degree {dp}")
    if pp > 1:
        try:
            plan.layers_per_stage(n_layers)
        except ValueError as error:
            reasons.append(str(error))
        if plan.micro_batches < pp:
            reasons.append(f"a pipeline of {pp} stages needs at least {pp} micro-batches (the plan has "
                           f"{plan.micro_batches})")
        base, extra = divmod(global_batch, dp)
        for share in {base, base + 1} if extra else {base}:
            if share % plan.micro_batches:
                reasons.append(
                    f"a data-parallel share of {share} samples does not split into {plan.micro_batches} equal "
                    "pipeline micro-batches (pipelining needs equal micro-batch shapes)"
                )
    return reasons


PINNED_AXES = ("pp", "dp", "tp")


def pinned_plan(mesh: dict[str, int], devices: int, *, sharded: bool, micro_batches: int,
                activation_checkpointing: str = "none", mixed_precision: str = "autocast") -> Plan:
    """The user's pinned plan (`parallelism.mesh`) on `devices`: tensor and pipeline degrees as
    pinned, the data axis taking the rest (how a pinned job re-pins after a resource change).
    ValueError where `devices` is not a multiple of tp x pp."""
    tp, pp = mesh.get("tp", 1), mesh.get("pp", 1)
    if devices % (tp * pp):
        raise ValueError(f"{devices} devices are not a multiple of the pinned tp x pp ({tp} x {pp})")
    dp = devices // (tp * pp)
    axes = {"pp": pp, "dp": dp, "tp": tp}
    named = {axis: axes[axis] for axis in PINNED_AXES if axes[axis] > 1} or {"dp": 1}
    return Plan(devices=devices, mesh=named, dp_shard=dp if sharded and dp > 1 else 1, micro_batches=micro_batches,
                strategy="pinned", activation_checkpointing=activation_checkpointing, mixed_precision=mixed_precision)
