"""train_job: a job spec in, a trained and checkpointed model out.

    validate -> profile -> for each resource segment: plan -> reshard plan -> launch -> report
"""

from __future__ import annotations

from prefect import flow

from specs import JobSpec
from tasks.launch import launch_training
from tasks.plan import plan_parallelism
from tasks.profile import profile_model
from tasks.records import SegmentResult, TrainSummary
from tasks.report import publish_report
from tasks.reshard import plan_reshard
from tasks.validate import validate_spec


@flow(name="train-job", flow_run_name="train-{spec.name}")
def train_job(spec: JobSpec) -> TrainSummary:
    """Train the job a spec describes, resuming from its latest committed checkpoint."""
    spec = validate_spec(spec)
    model = profile_model(spec)
    segments: list[SegmentResult] = []
    for devices, until_step in spec.resource_segments():
        plan = plan_parallelism(spec, model, devices)
        plan_reshard(spec, plan)  # what the workers will read, shown before they start
        segment = launch_training(spec, plan, until_step)
        segments.append(segment)
        if segment.stopped:  # asked to stop: the checkpoint is committed, the rest waits
            break
    return publish_report(spec, model, segments)
