"""The job-spec language: pydantic models of a parashift job, YAML loading with `file:line`
errors, the JSON Schema, and example specs (`specs/*.yaml`)."""

from pathlib import Path

from specs.base import CREDENTIAL_KEYS
from specs.loader import SpecError, SpecIssue, json_schema, load_spec, parse_spec
from specs.models import (
    DataSpec,
    JobSpec,
    ModelSpec,
    OptimizerSpec,
    ParallelismSpec,
    ResourceChange,
    ResourcesSpec,
    StorageSpec,
    TrainingSpec,
)

EXAMPLES_DIR = Path(__file__).resolve().parent


def example_path(name: str = "default") -> Path:
    """The path of a bundled example spec, e.g. `example_path("elastic-example")`."""
    return EXAMPLES_DIR / f"{name}.yaml"


__all__ = [
    "CREDENTIAL_KEYS",
    "EXAMPLES_DIR",
    "DataSpec",
    "JobSpec",
    "ModelSpec",
    "OptimizerSpec",
    "ParallelismSpec",
    "ResourceChange",
    "ResourcesSpec",
    "SpecError",
    "SpecIssue",
    "StorageSpec",
    "TrainingSpec",
    "example_path",
    "json_schema",
    "load_spec",
    "parse_spec",
]
