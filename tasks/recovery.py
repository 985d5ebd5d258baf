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
def recover_from_failure(spec: JobSpec, segments: list[SegmentResult],
                         resources: ResourceWatcher) -> tuple[int, list[str] | None]:
    """The devices (and, across nodes, the nodes) to resume on after the last segment failed.

    On one node: one device fewer than it had (the failed worker's device is presumed gone; a
    later resource event can bring it back), at least one. Across nodes: the nodes that did
    not leave (all of them when a worker died on a node that stayed: the same nodes again).
    Raises TrainingFailed when two failures in a row committed no new step (retrying again
    would only repeat them), or when no node is left."""
    logger = get_run_logger()
    failed = segments[-1]
    previous = segments[-2] if len(segments) > 1 else None
    no_progress = failed.final_step <= failed.start_step
    if no_progress and previous is not None and previous.outcome == "failed" and previous.final_step <= previous.start_step:
        raise TrainingFailed(
            f"{spec.job_id} cannot make progress: two failures in a row without a new checkpoint "
            f"(last: {failed.reason}); the last committed step is {failed.final_step}"
        )
    nodes = None
    if failed.nodes is not None:
        nodes = [n for n in failed.nodes if n not in failed.left_nodes]
        if not nodes:
            raise TrainingFailed(f"{spec.job_id}: every node left ({', '.join(failed.left_nodes)}); "
                                 f"the last committed step is {failed.final_step}")
        devices = spec.resources.node_devices(nodes)
    else:
        devices = max(1, failed.devices - 1)
    reason = "node-left" if failed.left_nodes else "failure"
    change = ResourceEvent(devices=devices, nodes=nodes, epoch=resources.highest_epoch + 1, reason=reason)
    resources.offer(change)  # recorded like any change; a newer event still wins
    if api_url() is not None:
        try:
            emit_resource_change(spec.job_id, change)  # visible in Prefect's event feed and to automations
        except Exception as error:  # noqa: BLE001 - the recovery itself does not depend on the feed
            logger.warning("could not emit the failure event: %s", error)
    logger.warning("%s failure on %d devices (%s): resuming from step %d on %s",
                   "node" if failed.left_nodes else "worker", failed.devices, failed.reason, failed.final_step,
                   change.describe())
    return devices, nodes
