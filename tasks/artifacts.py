"""Stable artifact keys: Prefect allows lowercase letters, digits and dashes only."""

from __future__ import annotations

import re
import threading
import time
from uuid import UUID


def artifact_key(job_id: str, what: str) -> str:
    return re.sub(r"[^a-z0-9-]+", "-", f"{job_id}-{what}".lower()).strip("-")


class TrainingProgress:
    """The run's progress artifact (percent of the job's steps), updated as steps are reported,
    at most once every `every_s` seconds: one API call, not one per step."""

    def __init__(self, job_id: str, total_steps: int, step: int = 0, every_s: float = 2.0) -> None:
        from prefect.artifacts import create_progress_artifact

        self.total_steps, self.every_s = total_steps, every_s
        self._last = 0.0
        self.id: UUID = create_progress_artifact(progress=self._percent(step), key=artifact_key(job_id, "progress"),
                                                 description=f"{job_id}: step {step} of {total_steps}")
        self.job_id = job_id

    def _percent(self, step: int) -> float:
        return round(100.0 * min(step, self.total_steps) / self.total_steps, 2)

    def update(self, step: int, force: bool = False) -> None:
        from prefect.artifacts import update_progress_artifact

        now = time.monotonic()
        if not force and now - self._last < self.every_s and step < self.total_steps:
            return
        self._last = now
        update_progress_artifact(self.id, self._percent(step), description=f"{self.job_id}: step {step} of {self.total_steps}")


def job_tags(job_id: str, model: str, devices: int) -> list[str]:
    """What a run is found by in the UI's filters: the job, the model's shape, its devices."""
    return [f"job:{job_id}", f"model:{model}", device_tag(devices)]


def device_tag(devices: int) -> str:
    """The tag of a device count the run trained on: an elastic run carries one per count."""
    return f"devices:{devices}"


def node_tag(node: str) -> str:
    """The tag of a node launcher run: which node it ran on."""
    return f"node:{node}"


def tag_this_run(tags: list[str]) -> None:
    """Add `tags` to the flow run in progress (a run's tags are otherwise fixed by whoever
    started it: the form, a schedule, a parent flow). Merged with the tags the run has now on
    the server, which earlier calls changed (the run context keeps those it started with)."""
    from prefect.client.orchestration import get_client
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    if context is None or context.flow_run is None:
        return
    with get_client(sync_client=True) as client:
        now = client.read_flow_run(context.flow_run.id).tags
        if not set(tags) <= set(now):
            client.update_flow_run(context.flow_run.id, tags=sorted(set(now) | set(tags)))


_tagging = threading.Lock()  # read-modify-write of the run's tags: one at a time


def tag_devices(devices: int) -> None:
    """The run's tags follow the job onto each new device count (`devices:2`, `devices:3`): the
    UI's filter finds the run under every count it trained on, not just the first. Two API
    calls (~30 ms; made once the segment trains, `tasks.views`). A tag that cannot be set is
    said and never stops training."""
    try:
        with _tagging:
            tag_this_run([device_tag(devices)])
    except Exception as error:  # noqa: BLE001 - a tag never stops training
        from prefect.logging import get_run_logger

        get_run_logger().warning("could not tag the run with %s: %s", device_tag(devices), error)
