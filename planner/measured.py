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


def option_cost(profile: MeasuredProfile, devices: int, dp_shard: int, global_batch: int, micro_batch: int) -> Option:
    """Estimated step seconds and memory per device of the dp axis over `devices` with the
    state sharded over `dp_shard` ranks (1: replicated)."""
    share = -(-global_batch // devices)
    micro = min(micro_batch, share)
    micro_batches = -(-share // micro)
    compute = profile.sequence_s * share
    comm, replicas = profile.comm, devices // dp_shard
    weights = PARAM_BYTES * profile.n_params
    if dp_shard == 1:
        sync = comm.bucketed_all_reduce(weights, devices)
    else:
        gathers = 2 * micro_batches * comm.all_gather(weights, dp_shard)
        reduce_scatter = micro_batches * comm.all_gather(weights, dp_shard)  # the same volume, the other way
        sync = gathers + reduce_scatter + comm.bucketed_all_reduce(weights / dp_shard, replicas)
    memory = STATE_BYTES * profile.n_params / dp_shard + profile.activation_bytes * micro
    if dp_shard > 1:
        memory += PARAM_BYTES * (profile.root_params + 2 * profile.layer_params)
    return Option(dp_shard=dp_shard, step_s=compute + sync, memory_bytes=memory)


def plan_measured(profile: MeasuredProfile, devices: int, global_batch: int, micro_batch: int,
                  memory_limit_bytes: int | None = None, shard_dp: bool = True) -> Plan:
    """The fastest fitting option of the data axis as a Plan (strategy "measured"); the one
    that needs least memory, marked infeasible, when none fits."""
    limit = memory_limit_bytes if memory_limit_bytes is not None else profile.device.memory_bytes
    shards = [s for s in range(1, devices + 1) if devices % s == 0] if shard_dp else [1]
    options = [option_cost(profile, devices, s, global_batch, micro_batch) for s in shards]
    fitting = [o for o in options if limit is None or o.memory_bytes <= limit]
    best = min(fitting, key=lambda o: (o.step_s, o.memory_bytes)) if fitting else min(options, key=lambda o: o.memory_bytes)
    listed = ", ".join(f"dp_shard {o.dp_shard}: {o.step_s * 1e3:.3g} ms, {o.memory_bytes / 2**20:.0f} MiB" for o in options)
    per_sequence = (f"{profile.sequence_s * 1e3:.3g} ms per sequence from its FLOPs at "
                    f"{profile.device.matmul_flops / 1e12:.4g} TFLOP/s, {profile.activation_bytes / 2**20:.1f} MiB kept "
                    "per sequence measured" if profile.sequence_from == "flops" else
                    f"{profile.sequence_s * 1e3:.1f} ms and {profile.activation_bytes / 2**20:.1f} MiB kept per sequence")
    notes = [f"{profile.name} has no op graph: options of the data axis costed from measurements of the model itself "
             f"({per_sequence}): {listed}"]
    if not fitting:
        notes.append(f"no option fits {limit / 2**30:.2f} GiB per device; the least memory is chosen")
    named = {"data-parallel": options[0], **({"fsdp": options[-1]} if len(options) > 1 else {})}
    return Plan(devices=devices, mesh={"dp": devices} if devices > 1 else {}, dp_shard=best.dp_shard,
                strategy="measured", estimated_step_s=best.step_s, memory_per_device_bytes=int(best.memory_bytes),
                baselines={name: o.step_s for name, o in named.items()},
                baseline_memory_bytes={name: int(o.memory_bytes) for name, o in named.items()},
                feasible=bool(fitting), notes=notes)


def measured_options(profile: MeasuredProfile, devices: int, global_batch: int, micro_batch: int,
                     memory_limit_bytes: int | None = None, shard_dp: bool = True) -> list[Plan]:
    """Every fitting option as a Plan, fastest first (a resumed job weighs moving its checkpoint too)."""
    best = plan_measured(profile, devices, global_batch, micro_batch, memory_limit_bytes, shard_dp)
    limit = memory_limit_bytes if memory_limit_bytes is not None else profile.device.memory_bytes
    shards = [s for s in range(1, devices + 1) if devices % s == 0] if shard_dp else [1]
    others = []
    for s in shards:
        option = option_cost(profile, devices, s, global_batch, micro_batch)
        if s != best.dp_shard and (limit is None or option.memory_bytes <= limit):
            others.append(best.model_copy(update={"dp_shard": s, "estimated_step_s": option.step_s,
                                                  "memory_per_device_bytes": int(option.memory_bytes)}))
    return [best, *sorted(others, key=lambda p: p.estimated_step_s or 0.0)]
