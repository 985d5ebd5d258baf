"""Stable artifact keys: Prefect allows lowercase letters, digits and dashes only."""

from __future__ import annotations

import re


def artifact_key(job_id: str, what: str) -> str:
    return re.sub(r"[^a-z0-9-]+", "-", f"{job_id}-{what}".lower()).strip("-")
