"""validate_spec: a path or a spec in, a validated JobSpec out."""

from __future__ import annotations

from pathlib import Path

from parashift.specs import JobSpec, load_spec
from parashift.specs.loader import resolve_model
from prefect import task


@task(name="validate-spec")
def validate_spec(spec: JobSpec | str | Path) -> JobSpec:
    """Load and validate a job spec, reading what its model refers to (a checkpoint folder's
    config); errors name the file, line and field (a spec given as an object: the field)."""
    if isinstance(spec, JobSpec):
        return resolve_model(spec)
    return load_spec(spec)
