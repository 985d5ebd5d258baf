"""launch_training: torchrun the workers for one segment, their output streamed into the run log."""

from __future__ import annotations

import statistics
from typing import Any

from prefect import task
from prefect.logging import get_run_logger

from planner.plan import Plan
from specs import JobSpec
from storage import JobPaths, ObjectStore
from tasks import progress
from tasks.credentials import environment, storage_environment
from tasks.records import SegmentResult
from trainer.launch import launch_workers


class TrainingFailed(RuntimeError):
    pass


# Workers always resume from the latest committed checkpoint, so a relaunch after a crash
# repeats no committed work and loses none: the one case where retrying training is safe.
@task(name="launch-training", retries=1, retry_delay_seconds=5)
def launch_training(spec: JobSpec, plan: Plan, until_step: int | None = None) -> SegmentResult:
    """Train on `plan.devices` workers until `until_step` (or the end), resuming if possible."""
    logger = get_run_logger()
    credentials = storage_environment(spec)
    with environment(credentials):
        store = ObjectStore(spec.storage.url, dict(spec.storage.storage_options))
        store.delete(JobPaths(spec.job_id).stop())  # a stop request belongs to the run it stopped

    def on_event(event: dict[str, Any]) -> None:
        progress.publish({**event, "total_steps": spec.training.steps})

    result = launch_workers(
        spec, plan, on_line=logger.info, on_event=on_event, until_step=until_step, extra_env=credentials
    )
    # torchrun exits non-zero when it was signalled itself, even though its workers stopped
    # cleanly at a committed step: a "stopped" event is what counts.
    if result.final_step is None or (result.returncode != 0 and not result.stopped):
        raise TrainingFailed(f"workers exited with code {result.returncode} (see the log above)")
    starts = [e for e in result.events if e["event"] == "start"]
    start = starts[-1] if starts else {}
    rates = [e["tokens_per_s"] for e in result.steps[1:]]  # the first step pays for warm-up
    return SegmentResult(
        devices=plan.devices,
        start_step=start.get("step", 0),
        final_step=result.final_step,
        stopped=result.stopped,
        losses=[(e["step"], e["loss"]) for e in result.steps],
        tokens_per_s=statistics.median(rates) if rates else None,
        checkpoint_urls=[e["url"] for e in result.checkpoints if e.get("url")],
        resumed_from_url=start.get("checkpoint_url"),
        resumed_loss=start.get("checkpoint_loss"),
    )
