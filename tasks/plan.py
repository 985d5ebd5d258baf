"""plan_parallelism: the Plan the workers execute, published as a table artifact."""

from __future__ import annotations

from prefect import task
from prefect.artifacts import create_table_artifact

from planner.plan import Plan
from specs import JobSpec
from tasks.artifacts import artifact_key
from tasks.records import ModelSummary


@task(name="plan-parallelism")
def plan_parallelism(spec: JobSpec, model: ModelSummary, devices: int) -> Plan:
    """Data parallel over `devices` (the trainer executes data-parallel plans today)."""
    plan = Plan.data_parallel(devices)
    create_table_artifact(
        key=artifact_key(spec.job_id, "plan"),
        table=[{"devices": plan.devices, "mesh": str(plan.mesh), "strategy": plan.strategy, "params": model.params}],
        description=f"Parallelization plan for {spec.job_id} on {devices} {spec.resources.kind} devices",
    )
    return plan
