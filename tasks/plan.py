"""plan_parallelism: the Plan the workers execute, published as a table artifact."""

from __future__ import annotations

import hashlib

from parashift.planner.measured import MeasuredProfile, measured_options, plan_measured
from parashift.planner.profile import ModelProfile
from parashift.planner.replan import Option, comparison, pick
from parashift.planner.search import plan_model, plan_options
from parashift.specs import JobSpec
from parashift.specs.plan import AC_MODES, Plan
from parashift.tasks.artifacts import artifact_key
from parashift.tasks.credentials import environment, storage_environment
from parashift.tasks.profile import load_profile
from parashift.tasks.records import ModelSummary
from parashift.tasks.reshard import job_reshard_plan
from prefect import task
from prefect.artifacts import create_table_artifact
from prefect.logging import get_run_logger


def executable_reasons(spec: JobSpec, plan: Plan) -> list[str]:
    """Why the trainer cannot run `plan` on this model and batch (empty when it can)."""
    from parashift.trainer.mesh import job_plan_refusals

    return job_plan_refusals(plan, spec)


def choose_plan(spec: JobSpec, searched: Plan, devices: int) -> Plan:
    """The planner's plan when the spec lets it choose and the trainer can run it; data parallel otherwise,
    carrying the planner's estimates so the artifact shows what was left on the table.

    The planner searches only layouts the trainer executes (gpt_graph declares them), so its
    plans for GPT graphs pass `executable_reasons`; the check stays as a safety net against the
    planner and the trainer drifting apart, and says so when it triggers."""
    if spec.parallelism.strategy == "auto":
        reasons = executable_reasons(spec, searched)
        if not reasons:
            return searched
        note = (f"planner's choice {searched.mesh} is refused by the trainer ({'; '.join(reasons)}), although the "
                "planner searches only executable layouts: planner and trainer disagree (a bug); data parallel instead")
    else:
        note = f"strategy data-parallel; the planner's choice would be {searched.mesh} at {searched.estimated_step_s:.4g} s"
    return Plan.data_parallel(
        devices,
        estimated_step_s=searched.baselines.get("data-parallel"),
        baselines=searched.baselines,
        notes=[*searched.notes, note],
    )


def pinned_with_estimate(plan: Plan, profile: ModelProfile | MeasuredProfile, spec: JobSpec) -> Plan:
    """The pinned plan with the cost model's step time and memory where it can estimate them."""
    from parashift.planner.pinned import estimate

    if isinstance(profile, MeasuredProfile):
        return plan
    par = spec.parallelism
    try:
        result = estimate(profile, plan, par.mixed_precision if par.precision == "bf16" else None)
    except ValueError:  # a layout the estimate does not cover (HSDP): the plan runs unestimated
        return plan
    return plan.model_copy(update={"estimated_step_s": result.time_s, "memory_per_device_bytes": int(result.memory_bytes)})


def with_memory_choices(spec: JobSpec, plan: Plan) -> Plan:
    """The plan with the spec's pinned memory choices: its activation checkpointing where the
    spec names one (else the planner's, 'none' for a data-parallel plan), and how bf16 compute
    is had (autocast, or FSDP2's mixed-precision policy)."""
    par = spec.parallelism
    ac = plan.activation_checkpointing if par.activation_checkpointing == "auto" else par.activation_checkpointing
    mixed = par.mixed_precision if par.precision == "bf16" else "autocast"
    return plan.model_copy(update={"activation_checkpointing": ac, "mixed_precision": mixed})


def default_read_bytes_per_s(url: str) -> float:
    """A store's read bandwidth before one was measured: local files ~1 GB/s, object stores ~100 MB/s."""
    return 1e9 if url.startswith(("file://", "/")) or "://" not in url else 1e8


def cheapest_to_continue(spec: JobSpec, options: list[Plan], step: int,
                         read_bytes_per_s: float | None) -> tuple[Option, list[dict[str, object]]] | None:
    """Among executable options, the plan that finishes the remaining steps first counting the
    move of the newest checkpoint onto it; None when nothing is committed (nothing to move)."""
    moves = []
    for plan in options:
        reshard = job_reshard_plan(spec, plan)
        if reshard is None:
            return None
        moves.append(Option(plan, plan.estimated_step_s or float("inf"), reshard.totals()["bytes_read"]))
    remaining = max(spec.training.steps - step, 0)
    bandwidth = read_bytes_per_s or default_read_bytes_per_s(spec.storage.url)
    return pick(moves, remaining, bandwidth), comparison(moves, remaining, bandwidth)


# Searches already made in this process, by everything their result depends on: a job that
# comes back to a device count (4 -> 2 -> 4) re-plans without searching again (0.5 s of a
# change's downtime for the trace benchmark's 4-device GPT).
_SEARCHED: dict[tuple[object, ...], Plan] = {}
_SEARCHED_MAX = 64


def ac_searched(spec: JobSpec) -> tuple[str, ...]:
    """The activation checkpointing the planner may choose: the spec's pinned mode, or every mode."""
    mode = spec.parallelism.activation_checkpointing
    return AC_MODES if mode == "auto" else (mode,)


def _search(spec: JobSpec, profile: ModelProfile | MeasuredProfile, devices: int, limit: int | None) -> Plan:
    """The planner's choice for `devices` (remembered: the search is deterministic)."""
    par, train = spec.parallelism, spec.training
    ac_modes = ac_searched(spec)
    key = (hashlib.sha256(profile.model_dump_json().encode()).hexdigest(), devices, limit, par.max_tp, par.max_pp,
           spec.resources.kind, par.shard_data_parallel, train.global_batch, train.micro_batch, ac_modes,
           par.mixed_precision)
    if key not in _SEARCHED:
        if isinstance(profile, MeasuredProfile):  # no op graph: the data axis's options, measured
            searched = plan_measured(profile, devices, train.global_batch, train.micro_batch, limit,
                                     shard_dp=par.shard_data_parallel)
        else:
            searched = plan_model(profile, devices, limit, par.max_tp, par.max_pp, device_kind=spec.resources.kind,
                                  shard_dp=par.shard_data_parallel, ac_modes=ac_modes,
                                  mixed_precision=par.mixed_precision)
        if len(_SEARCHED) >= _SEARCHED_MAX:
            _SEARCHED.pop(next(iter(_SEARCHED)))
        _SEARCHED[key] = searched
    return _SEARCHED[key].model_copy(deep=True)


@task(name="plan-parallelism")
def plan_parallelism(spec: JobSpec, model: ModelSummary, devices: int, step: int = 0,
                     read_bytes_per_s: float | None = None) -> Plan:
    """Search the parallelization for `devices` under the profiled cost model; publish it. A
    job resuming at `step` takes the plan that finishes first counting the move of its
    checkpoint (at `read_bytes_per_s`, measured by the last restore where there was one)."""
    logger = get_run_logger()
    profile = load_profile(spec, model.profile_key)
    par, train = spec.parallelism, spec.training
    limit = par.plan_memory_bytes(profile.device.memory_bytes)  # the device less the reserve for transients
    if limit is not None:
        logger.info("planning within %.2f GiB of each device's %.2f GiB (%.2f GiB reserved for transient buffers)",
                    limit / 2**30, profile.device.memory_bytes / 2**30, (profile.device.memory_bytes - limit) / 2**30)
    from parashift.trainer.mesh import pinned_plan_for  # torch: imported where a plan is made

    pinned, refused = pinned_plan_for(spec, devices)
    if pinned is not None:
        plan = pinned_with_estimate(pinned, profile, spec)
        searched = plan
    else:
        searched = _search(spec, profile, devices, limit)
        plan = choose_plan(spec, searched, devices)
        if refused:  # pinned, but not on this many devices: said, and the planner's choice instead
            logger.warning(refused)
            plan = plan.model_copy(update={"notes": [*plan.notes, refused]})
    if spec.parallelism.strategy == "auto" and step > 0:
        if isinstance(profile, MeasuredProfile):
            candidates = measured_options(profile, devices, train.global_batch, train.micro_batch, limit,
                                          shard_dp=par.shard_data_parallel)
        else:
            candidates = plan_options(profile, devices, limit, par.max_tp, par.max_pp, device_kind=spec.resources.kind,
                                      shard_dp=par.shard_data_parallel, searched=searched)
        options = [p for p in candidates if not executable_reasons(spec, p)]
        with environment(storage_environment(spec)):
            chosen = cheapest_to_continue(spec, options, step, read_bytes_per_s) if len(options) > 1 else None
        if chosen is not None:
            best, rows = chosen
            create_table_artifact(key=artifact_key(spec.job_id, f"plan-choice-{devices}"), table=rows,
                                  description=f"Plans for {spec.job_id} on {devices} devices from step {step}: "
                                  "estimated step time x remaining steps + moving the checkpoint")
            fastest = min(options, key=lambda p: p.estimated_step_s or float("inf"))
            if best.plan is not fastest:
                note = (f"{best.plan.mesh} chosen over the faster-stepping {fastest.mesh}: its checkpoint move is "
                        f"cheaper over the {spec.training.steps - step} remaining steps")
                best = Option(best.plan.model_copy(update={"notes": [*best.plan.notes, note]}), best.step_s, best.move_bytes)
            plan = best.plan
    plan = with_memory_choices(spec, plan).model_copy(update={"device_peak_flops": profile.device.matmul_flops})
    for note in plan.notes:
        logger.info(note)
    rows = [
        {"op": p.op, "stage": p.stage, "splits": " ".join(f"{d}/{'x'.join(a)}" for d, a in p.splits.items()) or "replicated",
         "compute_ms": round(p.compute_s * 1e3, 4), "comm_ms": round(p.comm_s * 1e3, 4), "memory_mb": round(p.memory_bytes / 2**20, 2)}
        for p in plan.placements
    ] or [{"mesh": str(plan.mesh), "strategy": plan.strategy, "estimated_step_s": plan.estimated_step_s}]
    create_table_artifact(
        key=artifact_key(spec.job_id, f"plan-{devices}"),
        table=rows,
        description=(
            f"Plan for {spec.job_id} on {devices} {spec.resources.kind} devices: mesh {plan.mesh}, "
            f"estimated {plan.estimated_step_s or float('nan'):.4g} s/step; baselines "
            + ", ".join(f"{k} {v:.4g} s" for k, v in plan.baselines.items())
        ),
    )
    return plan
