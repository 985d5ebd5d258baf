"""plan_parallelism: the Plan the workers execute, published as a table artifact."""

from __future__ import annotations

from prefect import task
from prefect.artifacts import create_table_artifact
from prefect.logging import get_run_logger

from planner.plan import Plan
from planner.search import plan_model
from specs import JobSpec
from tasks.artifacts import artifact_key
from tasks.profile import load_profile
from tasks.records import ModelSummary


def executable_reasons(spec: JobSpec, plan: Plan) -> list[str]:
    """Why the trainer cannot run `plan` on this model and batch (empty when it can)."""
    from trainer.mesh import job_plan_refusals

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


@task(name="plan-parallelism")
def plan_parallelism(spec: JobSpec, model: ModelSummary, devices: int) -> Plan:
    """Search the parallelization for `devices` under the profiled cost model; publish it."""
    logger = get_run_logger()
    profile = load_profile(spec, model.profile_key)
    par = spec.parallelism
    searched = plan_model(profile, devices, None, par.max_tp, par.max_pp, device_kind=spec.resources.kind)
    plan = choose_plan(spec, searched, devices)
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
