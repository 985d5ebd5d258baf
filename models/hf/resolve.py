"""An `hf` spec section with its `init_from` folder's config read (no torch, no transformers)."""

from __future__ import annotations

from parashift.models.hf.spec import HFSpec
from parashift.models.hub import CONFIG_NAME, read_config
from parashift.specs.base import FieldIssues


def resolve(spec: HFSpec) -> HFSpec:
    """`config` filled from the folder's config.json; a key the spec gives that differs is an
    error at that key."""
    if spec.init_from is None:
        return spec
    folder = read_config(spec.init_from)
    if not isinstance(folder.get("model_type"), str):
        raise FieldIssues([(("init_from",), f"{spec.init_from}/{CONFIG_NAME} names no model_type")])
    given = spec.config or {}
    issues = [(("config", key), f"is {value!r} but {spec.init_from}/{CONFIG_NAME} says {folder[key]!r}")
              for key, value in given.items() if key in folder and folder[key] != value]
    if issues:
        raise FieldIssues(issues)
    return spec.model_copy(update={"config": {**folder, **given}})
