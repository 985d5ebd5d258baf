"""validate_spec: a path or a spec in, a validated JobSpec out."""

from __future__ import annotations

from pathlib import Path

from prefect import task

from specs import JobSpec, load_spec


@task(name="validate-spec")
def validate_spec(spec: JobSpec | str | Path) -> JobSpec:
    """Load and validate a job spec; errors name the file, line and field."""
    if isinstance(spec, JobSpec):
        return spec
    return load_spec(spec)
