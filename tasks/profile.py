"""profile_model: what the planner needs to know about the model, cached in the job's storage.

The profile (op graph, compute rates, communication model) is stored as JSON under
`jobs/{job}/profile/{hash}.json`; tasks pass its key along, never the profile itself.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable

from parashift.models import family_of
from parashift.planner.comm import CommModel, comm_model_from_timings
from parashift.planner.measured import MeasuredProfile, profile_from_measurements
from parashift.planner.profile import DeviceModel, ModelProfile, measurable_here, profile_graph, share_cores
from parashift.specs import JobSpec
from parashift.specs.plan import AC_MODES
from parashift.storage import JobPaths, open_store
from parashift.tasks.credentials import environment, storage_environment
from parashift.tasks.records import ModelSummary
from parashift.tasks.retry import retry_if_it_may_help
from prefect import task
from prefect.logging import get_run_logger


def needs_measurement(spec: JobSpec) -> bool:
    """Measured rates matter when the planner chooses; a data-parallel job only reports estimates."""
    return spec.parallelism.strategy == "auto"


# Bumped when what a profile holds changes meaning (new measured fields, new graph
# declarations), so profiles cached by an older planner are rebuilt rather than misread.
PROFILE_FORMAT = 4  # 2: p2p link, core share, graphs declaring the trainer's tp layouts; 3: model families;
# 4: the precision in the key, measured profiles with their checkpointing modes


def profile_key(spec: JobSpec) -> str:
    """A profile goes stale when the model, the batch, the devices or their kind change, or the
    profile format does, and only then."""
    basis = {
        "format": PROFILE_FORMAT,
        "model": spec.model.model_dump(),
        "batch": spec.training.global_batch,
        "kind": spec.resources.kind,
        "devices": spec.resources.devices,
        "devices_per_node": spec.resources.devices_per_node,
        "nodes": len(spec.resources.nodes) if spec.resources.nodes else None,
        "memory_gb": spec.resources.memory_gb,
        "measured": needs_measurement(spec),
        "precision": spec.parallelism.precision,  # what activations weigh
        "checkpointing": checkpointing_measured(spec),
    }
    return hashlib.sha256(json.dumps(basis, sort_keys=True).encode()).hexdigest()[:16]


def checkpointing_measured(spec: JobSpec) -> tuple[str, ...]:
    """The activation checkpointing modes a model without an op graph is measured under: every
    one where its planner chooses (strategy auto, checkpointing auto), else the one it runs."""
    par = spec.parallelism
    if par.activation_checkpointing == "auto":
        return AC_MODES if par.strategy == "auto" else ("none",)
    return tuple(dict.fromkeys(("none", par.activation_checkpointing)))


def exact_parameter_count(spec: JobSpec) -> tuple[int, int]:
    """Parameters and training FLOPs per token of the model the workers build (on the meta device)."""
    family = family_of(spec.model)
    model = family.build_on_meta(spec.model)
    params = sum(p.numel() for p in model.parameters())
    return params, family.flops_per_token(spec.model, params)


def build_profile(spec: JobSpec, comm: CommModel | None = None,
                  device: DeviceModel | None = None) -> ModelProfile | MeasuredProfile:
    """The planner's profile: GEMM rates timed here (or `device`'s, timed for another device
    count of the job) and collectives timed on the job's own workers when the planner will
    choose; the defaults for the device kind otherwise."""
    from parashift.launcher.launch import measure_comm_timings

    measure = needs_measurement(spec)
    res, m = spec.resources, spec.model
    if measure and res.devices > 1 and comm is None:
        timings = measure_on_nodes(spec) if res.nodes else measure_comm_timings(res.devices, res.kind)
        comm = comm_model_from_timings(timings, res.devices_per_node)
    batch = spec.training.global_batch
    family = family_of(m)
    workers = res.devices_per_node if res.nodes else res.devices
    if family.graph_builder is None:  # no op graph: the data axis's options, costed from the model measured
        return measured_profile(spec, comm)
    graph = family.graph(m, batch, spec.parallelism.precision)
    # A job across nodes may plan on a head node without its GPUs: the kind's default rates there.
    profile = profile_graph(graph, res.kind, measure and measurable_here(res.kind), memory_gb=res.memory_gb,
                            devices_per_node=res.devices_per_node, comm=comm, tokens=batch * m.seq_len,
                            device=device if measure else None)
    # CPU workers on a host share its cores (across nodes: a node's workers share that node's).
    return profile.model_copy(update={"device": share_cores(profile.device, workers)})


def measured_profile(spec: JobSpec, comm: CommModel | None) -> MeasuredProfile:
    """A model without an op graph (the hf family) measured here: one sequence's forward and
    backward, what autograd keeps, its parameters (planner/measured.py)."""
    from parashift.trainer.measure_model import measure_for_gpus, measure_model

    res, train = spec.resources, spec.training
    modes = checkpointing_measured(spec)
    measured = (measure_model(spec.model, train.micro_batch, spec.parallelism.precision, train.seed, modes=modes)
                if res.kind == "cpu" else measure_for_gpus(spec.model, spec.parallelism.precision, train.seed, modes))
    return profile_from_measurements(spec.model.tag, measured, res.kind, res.devices_per_node if res.nodes else res.devices,
                                     res.memory_gb, comm, res.devices_per_node, seq_len=spec.model.seq_len)


def measure_on_nodes(spec: JobSpec) -> dict:
    """Collectives timed on the job's own nodes, within a node and across nodes: one launcher
    per node running `trainer.measure_comm` (tasks/nodes.py)."""
    from parashift.specs.plan import Plan
    from parashift.tasks.nodes import node_launch
    from parashift.trainer.events import CommTimingsEvent

    with environment(storage_environment(spec)):
        store = open_store(spec.storage)
        result, left = node_launch(spec, Plan.data_parallel(spec.resources.devices), None, store,
                                   measure_comm=True).run()
    timings = [e.timings for e in result.of(CommTimingsEvent)]
    if left or result.returncode != 0 or not timings:
        raise RuntimeError(f"timing collectives on nodes {spec.resources.nodes} failed (exit {result.returncode}, "
                           f"left: {left or 'none'})")
    return timings[-1]


def load_profile(spec: JobSpec, key: str) -> ModelProfile | MeasuredProfile:
    """The stored profile: an op graph's, or (a model without one) the measured one."""
    with environment(storage_environment(spec)):
        stored = open_store(spec.storage).get_json(key)
    return ModelProfile.model_validate(stored) if "graph" in stored else MeasuredProfile.model_validate(stored)


class NeedsMeasurement(RuntimeError):
    """Profiling this count would time collectives on the job's workers first (a launch of its own)."""


def measured_rates(spec: JobSpec, key: str | None) -> tuple[CommModel | None, DeviceModel | None]:
    """The collectives and the device rates measured for another device count of the job (the
    profile at `key`): a fitted latency and bandwidth per link, whatever the group size, and one
    worker's GEMM and memory rates, whatever the count (`share_cores` rescales a CPU's to the
    new count's share of the cores), so a new count needs no new measurement (issue 26: a change
    of device count measured collectives for 65 s; a count planned ahead timed GEMMs for ~0.5 s
    of a core the training workers were using, and read them ~15% slow for it)."""
    if key is None:
        return None, None
    with environment(storage_environment(spec)):
        stored = open_store(spec.storage).get_json(key)
    comm = CommModel.model_validate(stored["comm"])
    device = DeviceModel.model_validate(stored["device"]) if "graph" in stored else None
    return (comm if comm.measured else None), (device if device is not None and device.measured else None)


def ensure_profile(spec: JobSpec, rates_from: str | None = None, say: Callable[[str], None] = lambda line: None,
                   may_measure: bool = True) -> ModelSummary:
    """The body of `profile_model`, without Prefect: what `tasks.plan.PlansAhead` runs while the job
    trains. `may_measure=False`: NeedsMeasurement rather than launch workers to time collectives."""
    key = JobPaths(spec.job_id).profile(profile_key(spec))
    params, per_token = exact_parameter_count(spec)
    with environment(storage_environment(spec)):
        store = open_store(spec.storage)
        if store.exists(key):
            say(f"reusing profile {store.url_for(key)}")
        else:
            comm, device = measured_rates(spec, rates_from)
            res = spec.resources
            if not may_measure and comm is None and needs_measurement(spec) and res.devices > 1:
                raise NeedsMeasurement(f"profiling {res.devices} devices times collectives first")
            profile = build_profile(spec, comm, device)
            store.put_json(key, profile.model_dump(mode="json"))
            used = "measured" if profile.comm.measured else "default"
            if isinstance(profile, MeasuredProfile):
                say(f"measured {profile.name}: {profile.sequence_s * 1e3:.1f} ms and "
                    f"{profile.activation_bytes / 2**20:.1f} MiB kept per sequence; comm {used}")
            else:
                say(f"profiled {len(profile.graph.ops)} ops; {profile.device.matmul_flops:.3g} FLOP/s GEMM "
                    f"({_rates_from(profile.device.measured, device is not None, res.kind)}); comm {used}")
    say(f"model: {params:,} parameters, {per_token:,} FLOPs per token")
    return ModelSummary(params=params, flops_per_token=per_token, device_kind=spec.resources.kind, profile_key=key)


def _rates_from(measured: bool, reused: bool, kind: str) -> str:
    if measured:
        return "measured for another device count of the job" if reused else "measured"
    return "default" if measurable_here(kind) else f"default: no {kind} device where this flow runs"


@task(name="profile-model", retries=2, retry_delay_seconds=2, retry_condition_fn=retry_if_it_may_help)
def profile_model(spec: JobSpec, rates_from: str | None = None) -> ModelSummary:
    """Profile the model, or reuse the profile stored for the same model, batch and devices.
    `rates_from`: the key of this job's profile on another device count, whose measured
    collectives and device rates serve this one too."""
    return ensure_profile(spec, rates_from, get_run_logger().info)
