"""The job-spec language: pydantic models of a parashift job, YAML loading with `file:line`
errors, the JSON Schema, and example specs (`specs/*.yaml`).

Names are loaded on first use (PEP 562): model families' spec sections (models/*/spec.py)
import `specs.base`, and `specs.models` imports them, so this package must not import
`specs.models` before a family's section has finished loading.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

EXAMPLES_DIR = Path(__file__).resolve().parent

_WHERE = {
    "CREDENTIAL_KEYS": "parashift.specs.base",
    "SpecError": "parashift.specs.loader",
    "SpecIssue": "parashift.specs.loader",
    "json_schema": "parashift.specs.loader",
    "load_spec": "parashift.specs.loader",
    "parse_spec": "parashift.specs.loader",
    **{name: "parashift.specs.models" for name in ("DataSpec", "JobSpec", "ModelSpec", "OptimizerSpec", "ParallelismSpec",
                                         "ResourceChange", "ResourcesSpec", "StorageSpec", "TrainingSpec")},
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'specs' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value


def example_path(name: str = "default") -> Path:
    """The path of a bundled example spec, e.g. `example_path("elastic-example")`."""
    return EXAMPLES_DIR / f"{name}.yaml"


__all__ = ["EXAMPLES_DIR", "example_path", *_WHERE]
