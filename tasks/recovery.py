"""announce_change: a change the job makes itself (a dead worker, a node gone) becomes a resource
event like any other: recorded in the job's storage and emitted to Prefect's event feed. What the
change is, and when there is none to make, is the elastic policy's (`specs.elastic`)."""

from __future__ import annotations

from parashift.specs import JobSpec
from parashift.specs.elastic import Replan, ResourceEvent
from parashift.tasks.events import ResourceWatcher, api_url, emit_resource_change
from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.logging import get_run_logger


class TrainingFailed(RuntimeError):
    """The job cannot make progress (the reason is in the message)."""


@task(name="announce-change", cache_policy=NO_CACHE)
def announce_change(spec: JobSpec, change: Replan, resources: ResourceWatcher) -> ResourceEvent | None:
    """Record and emit `change` with an epoch above every one heard; the event it became (None:
    an event heard meanwhile has that epoch already, and wins)."""
    logger = get_run_logger()
    logger.warning("%s", change.why)
    event = change.as_event(resources.highest_epoch + 1)
    if not resources.offer(event):  # recorded like any change
        return None
    if api_url() is not None:
        try:
            emit_resource_change(spec.job_id, event)  # visible in Prefect's event feed and to automations
        except Exception as error:  # noqa: BLE001 - the recovery itself does not depend on the feed
            logger.warning("could not emit the %s event: %s", change.reason, error)
    return event
