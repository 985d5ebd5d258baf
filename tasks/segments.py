"""A job's resource schedule as segments: (devices, last step) pairs, from the spec's scripted
elasticity. The workers checkpoint at each segment's last step and the next segment resumes
from it on its own device count."""

from __future__ import annotations

from specs import JobSpec


def resource_segments(spec: JobSpec) -> list[tuple[int, int]]:
    segments: list[tuple[int, int]] = []
    devices = spec.resources.devices
    for change in spec.elasticity:
        segments.append((devices, change.at_step))
        devices = change.devices
    segments.append((devices, spec.training.steps))
    return segments
