"""recover_from_failure: a dead worker becomes a resource change with reason `failure`."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.logging import get_run_logger

from specs import JobSpec
from tasks.events import ResourceEvent, ResourceWatcher, api_url, emit_resource_change
from tasks.records import SegmentResult


class TrainingFailed(RuntimeError):
    """The job cannot make progress (the reason is in the message)."""


@task(name="recover-from-failure", cache_policy=NO_CACHE)
def recover_from_failure(spec: JobSpec, segments: list[SegmentResult], resources: ResourceWatcher) -> int:
    """The device count to resume on after the last segment failed: one fewer than it had (the
    failed worker's device is presumed gone; a later resource event can bring it back), at least
    one. Raises TrainingFailed when two failures in a row committed no new step: retrying again
    would only repeat them."""
    logger = get_run_logger()
    failed = segments[-1]
    previous = segments[-2] if len(segments) > 1 else None
    no_progress = failed.final_step <= failed.start_step
    if no_progress and previous is not None and previous.outcome == "failed" and previous.final_step <= previous.start_step:
        raise TrainingFailed(
            f"{spec.job_id} cannot make progress: two failures in a row without a new checkpoint "
            f"(last: {failed.reason}); the last committed step is {failed.final_step}"
        )
    devices = max(1, failed.devices - 1)
    change = ResourceEvent(devices=devices, epoch=resources.highest_epoch + 1, reason="failure")
    resources.offer(change)  # recorded like any change; a newer event still wins
    if api_url() is not None:
        try:
            emit_resource_change(spec.job_id, change)  # visible in Prefect's event feed and to automations
        except Exception as error:  # noqa: BLE001 - the recovery itself does not depend on the feed
            logger.warning("could not emit the failure event: %s", error)
    logger.warning("worker failure on %d devices (%s): resuming from step %d on %d devices",
                   failed.devices, failed.reason, failed.final_step, devices)
    return devices
