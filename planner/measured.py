"""Planning a model the planner has no op graph of (the `hf` family: any `transformers` causal
LM) from a measured profile: its options are what the trainer can execute for it — the data
axis replicating the training state, sharding it (FSDP) or both (HSDP) — and each is costed
from measurements of the model itself rather than per-op rates.

Measured (trainer/measure_model.py, one process, one thread as a CPU worker runs): the seconds
of one sequence's forward and backward, the bytes autograd keeps for it, the parameters of the
whole model and of its largest decoder layer. Costed per option, with the job's communication
model (planner/comm.py):

    compute        sequence seconds x the data-parallel share of the global batch
    replicated     gradients all-reduced over dp (bucketed: full bandwidth)
    FSDP over s    every micro-batch gathers the weights twice (forward, and backward after
                   resharding) and reduce-scatters the gradients, over s ranks; with r = dp / s
                   replicas (HSDP) the gradient shards are all-reduced over r
    memory         fp32 weights, gradients and AdamW's two moments / s, the activations of one
                   micro-batch, and under FSDP the root's and the largest layer's weights and
                   gradients gathered whole

The fastest option that fits the device's memory is chosen; the plan says it was measured and
lists every option.
"""

from __future__ import annotations

from parashift.planner.checkpointing import policy_on
from parashift.planner.comm import CommModel, default_comm
from parashift.planner.profile import DEFAULT_DEVICES, DeviceModel, share_cores
from parashift.specs.plan import Plan
from pydantic import BaseModel, ConfigDict, Field

# fp32 weight, gradient and AdamW's two moments: what the state holds per parameter.
STATE_BYTES = 16
PARAM_BYTES = 4


class MeasuredProfile(BaseModel):
    """What the options of a model without an op graph are costed from."""

    model_config = ConfigDict(extra="forbid")

    name: str
    n_params: int = Field(ge=0)
    flops_per_token: float = Field(ge=0)
    layer_params: int = Field(ge=0, description="parameters of the largest decoder layer (FSDP's unit)")
    root_params: int = Field(ge=0, description="parameters outside the decoder layers (gathered for the whole step)")
    sequence_s: float = Field(gt=0, description="forward + backward of one sequence on one device, measured")
    activation_bytes: float = Field(ge=0, description="bytes autograd keeps for one sequence, measured")
    cast_bytes: float = Field(0.0, ge=0, description="bytes a forward keeps once whatever its batch: autocast's "
                                                      "bf16 copies of the weights, measured")
    cast_bytes_by_ac: dict[str, float] = Field(default_factory=dict, description="`cast_bytes` per checkpointing mode")
    activation_bytes_by_ac: dict[str, float] = Field(
        default_factory=dict, description="bytes one sequence keeps with every decoder layer checkpointed, per mode "
                                          "(selective, full), measured; a mode not measured is not searched")
    layer_kept_by_ac: dict[str, float] = Field(
        default_factory=dict, description="bytes one decoder layer keeps of one sequence, per mode (none included): "
                                          "a checkpointed layer holds its whole again while its backward runs")
    sequence_from: str = Field("measured", description="where sequence_s came from: measured, or the model's "
                                                       "FLOPs at the device's rate")
    device: DeviceModel
    comm: CommModel


def profile_from_measurements(name: str, measured: dict[str, float], device_kind: str, workers: int,
                              memory_gb: float | None = None, comm: CommModel | None = None,
                              devices_per_node: int | None = None, *, seq_len: int) -> MeasuredProfile:
    """A MeasuredProfile from `trainer.measure_model`'s numbers (one CPU thread), for `workers`
    processes per host: CPU workers outnumbering the cores each get a share of one. A GPU's
    sequence seconds are its FLOPs (`seq_len` tokens) at the device's rate, as the op-graph
    planner costs GEMMs: the CPU's time (the measurement runs there) was taken for the GPU's,
    ~1000x too slow against the GPU's collectives."""
    device = DEFAULT_DEVICES.get(device_kind, DEFAULT_DEVICES["cuda"]).model_copy()
    if memory_gb is not None:
        device.memory_bytes = int(memory_gb * 2**30)
    if device_kind != "cpu":
        sequence_s, source = measured["flops_per_token"] * seq_len / device.matmul_flops, "flops"
    else:
        sequence_s, source = measured["sequence_s"] / share_cores(device, workers).core_share, "measured"
    return MeasuredProfile(name=name, device=device, comm=comm or default_comm(device_kind, devices_per_node),
                           **{**measured, "sequence_s": sequence_s, "sequence_from": source})


class Option(BaseModel):
    dp_shard: int
    step_s: float
    memory_bytes: float
    activation_checkpointing: str = "none"


def priced_modes(profile: MeasuredProfile, ac_modes: tuple[str, ...]) -> tuple[str, ...]:
    """The checkpointing modes of `ac_modes` the profile can price (a profile measured before
    modes were measured has none but "none")."""
    return tuple(m for m in ac_modes if m == "none" or m in profile.activation_bytes_by_ac) or ("none",)


def recompute_share(profile: MeasuredProfile, mode: str) -> float:
    """The share of a sequence's seconds a mode adds: "full" runs the decoder layers' forward
    again, a third of their forward and backward (their share of the model's FLOPs taken as
    their share of its parameters: the head's GEMM is not recomputed); "selective" recomputes
    norms, activations and casts, no GEMMs: no FLOPs, so nothing on this FLOP-based model, and
    among equal options the earlier mode ("none") wins: checkpointing only where memory needs it."""
    if mode != "full" or profile.n_params == 0:
        return 0.0
    return (profile.n_params - profile.root_params) / profile.n_params / 3


def option_cost(profile: MeasuredProfile, devices: int, dp_shard: int, global_batch: int, micro_batch: int,
                activation_checkpointing: str = "none", mixed_precision: str | None = None) -> Option:
    """Estimated step seconds and memory per device of the dp axis over `devices` with the
    state sharded over `dp_shard` ranks (1: replicated), every decoder layer checkpointed as
    `activation_checkpointing` says. Under FSDP2's bf16 policy (`mixed_precision` "fsdp", with a
    data axis: `checkpointing.policy_on`) weights are gathered and used in bf16: no autocast
    copies, half the gather (the measured activations, taken under autocast, are kept as an
    upper bound: the policy's own keep some in bf16 that autocast keeps in fp32)."""
    share = -(-global_batch // devices)
    micro = min(micro_batch, share)
    micro_batches = -(-share // micro)
    ac = activation_checkpointing
    compute = profile.sequence_s * share * (1 + recompute_share(profile, ac))
    comm, replicas = profile.comm, devices // dp_shard
    bf16_params = policy_on(mixed_precision, devices) == "fsdp"
    gathered = 2 if bf16_params else PARAM_BYTES
    weights = PARAM_BYTES * profile.n_params
    if dp_shard == 1:
        sync = comm.bucketed_all_reduce(weights, devices)
    else:
        gathers = 2 * micro_batches * comm.all_gather(gathered * profile.n_params, dp_shard)
        reduce_scatter = micro_batches * comm.all_gather(weights, dp_shard)  # fp32 gradients, the other way
        sync = gathers + reduce_scatter + comm.bucketed_all_reduce(weights / dp_shard, replicas)
    kept, casts = profile.activation_bytes, profile.cast_bytes
    if ac != "none":  # and while a layer's backward runs, its whole again (less what it keeps)
        layer = profile.layer_kept_by_ac
        kept = profile.activation_bytes_by_ac[ac] + layer.get("none", 0.0) - layer.get(ac, 0.0)
        casts = profile.cast_bytes_by_ac.get(ac, 0.0)
    memory = STATE_BYTES * profile.n_params / dp_shard + (0.0 if bf16_params else casts) + kept * micro
    if dp_shard > 1:
        memory += gathered * (profile.root_params + 2 * profile.layer_params)
    elif bf16_params:  # FSDP2's `replicate` holds the whole model's bf16 copy for the step
        memory += 2 * profile.n_params
    return Option(dp_shard=dp_shard, step_s=compute + sync, memory_bytes=memory, activation_checkpointing=ac)


def all_options(profile: MeasuredProfile, devices: int, global_batch: int, micro_batch: int, shard_dp: bool,
                ac_modes: tuple[str, ...], mixed_precision: str | None = None) -> list[Option]:
    """Every option, per checkpointing mode (in `ac_modes`' order: ties go to the earlier) and shard count."""
    shards = [s for s in range(1, devices + 1) if devices % s == 0] if shard_dp else [1]
    return [option_cost(profile, devices, s, global_batch, micro_batch, mode, mixed_precision)
            for mode in priced_modes(profile, ac_modes) for s in shards]


def plan_measured(profile: MeasuredProfile, devices: int, global_batch: int, micro_batch: int,
                  memory_limit_bytes: int | None = None, shard_dp: bool = True,
                  ac_modes: tuple[str, ...] = ("none",), mixed_precision: str | None = None) -> Plan:
    """The fastest fitting option of the data axis and checkpointing (`ac_modes`, each priced
    from its own measurement) as a Plan (strategy "measured"); the one that needs least memory,
    marked infeasible, when none fits."""
    limit = memory_limit_bytes if memory_limit_bytes is not None else profile.device.memory_bytes
    options = all_options(profile, devices, global_batch, micro_batch, shard_dp, ac_modes, mixed_precision)
    fitting = [o for o in options if limit is None or o.memory_bytes <= limit]
    order = {mode: i for i, mode in enumerate(ac_modes)}  # among equal step times the earlier mode, then less memory
    best = (min(fitting, key=lambda o: (o.step_s, order[o.activation_checkpointing], o.memory_bytes)) if fitting
            else min(options, key=lambda o: o.memory_bytes))
    several = len({o.activation_checkpointing for o in options}) > 1
    listed = ", ".join(f"dp_shard {o.dp_shard}{f' {o.activation_checkpointing}' if several else ''}: "
                       f"{o.step_s * 1e3:.3g} ms, {o.memory_bytes / 2**20:.0f} MiB" for o in options)
    kept = ", ".join(f"{profile.activation_bytes_by_ac[m] / 2**20:.1f} MiB under {m} checkpointing"
                     for m in priced_modes(profile, ac_modes) if m != "none")
    kept = f" ({kept})" if kept else ""
    if profile.cast_bytes:
        kept += f", {profile.cast_bytes / 2**20:.1f} MiB of autocast's weight copies per forward"
    per_sequence = (f"{profile.sequence_s * 1e3:.3g} ms per sequence from its FLOPs at "
                    f"{profile.device.matmul_flops / 1e12:.4g} TFLOP/s, {profile.activation_bytes / 2**20:.1f} MiB kept "
                    f"per sequence measured{kept}" if profile.sequence_from == "flops" else
                    f"{profile.sequence_s * 1e3:.1f} ms and {profile.activation_bytes / 2**20:.1f} MiB kept per "
                    f"sequence{kept}")
    notes = [f"{profile.name} has no op graph: options of the data axis costed from measurements of the model itself "
             f"({per_sequence}): {listed}"]
    if not fitting:
        notes.append(f"no option fits {limit / 2**30:.2f} GiB per device; the least memory is chosen")
    plain = [o for o in options if o.activation_checkpointing == options[0].activation_checkpointing]
    named = {"data-parallel": plain[0], **({"fsdp": plain[-1]} if len(plain) > 1 else {})}
    return Plan(devices=devices, mesh={"dp": devices} if devices > 1 else {}, dp_shard=best.dp_shard,
                strategy="measured", estimated_step_s=best.step_s, memory_per_device_bytes=int(best.memory_bytes),
                activation_checkpointing=best.activation_checkpointing,
                baselines={name: o.step_s for name, o in named.items()},
                baseline_memory_bytes={name: int(o.memory_bytes) for name, o in named.items()},
                feasible=bool(fitting), notes=notes)


def measured_options(profile: MeasuredProfile, devices: int, global_batch: int, micro_batch: int,
                     memory_limit_bytes: int | None = None, shard_dp: bool = True,
                     ac_modes: tuple[str, ...] = ("none",), mixed_precision: str | None = None) -> list[Plan]:
    """Every fitting option as a Plan, fastest first (a resumed job weighs moving its checkpoint too)."""
    best = plan_measured(profile, devices, global_batch, micro_batch, memory_limit_bytes, shard_dp, ac_modes,
                         mixed_precision)
    limit = memory_limit_bytes if memory_limit_bytes is not None else profile.device.memory_bytes
    others = []
    for option in all_options(profile, devices, global_batch, micro_batch, shard_dp, ac_modes, mixed_precision):
        if (option.dp_shard, option.activation_checkpointing) == (best.dp_shard, best.activation_checkpointing):
            continue
        if limit is None or option.memory_bytes <= limit:
            others.append(best.model_copy(update={"dp_shard": option.dp_shard, "estimated_step_s": option.step_s,
                                                  "memory_per_device_bytes": int(option.memory_bytes),
                                                  "activation_checkpointing": option.activation_checkpointing}))
    return [best, *sorted(others, key=lambda p: p.estimated_step_s or 0.0)]
