"""Model families, registered by name (after torchtitan's model registry).

A family is one folder: the single-device module (`model.py`), its spec section (`spec.py`: a
pydantic section with a `family:` discriminator, imported by `specs` without torch), one
sharding table from which tensor-parallel styles, shard dims, pipeline stages and checkpoint
layouts are derived (`models.sharding`), FLOPs per token, initialisation, the planner's graph
(`graph.py`, loaded only by the planner's side: the trainer never imports the planner) and, where
it has one, its Hugging Face adapter. Adding a family is one folder and one line below
(docs/models.md).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from parashift.models.base import ModelFamily

# family name -> the package holding it
FAMILIES: dict[str, str] = {
    "gpt": "parashift.models.gpt",
    "llama": "parashift.models.llama",
    "hf": "parashift.models.hf",
}

# A spec whose `model:` names no family trains the GPT (every spec before families existed).
DEFAULT_FAMILY = "gpt"


class ModelUnbuildable(ValueError):
    """A family cannot build the model a spec names (a field only building it checks, e.g. a
    transformers model type): `field` is the spec's field to change, the message one line."""

    def __init__(self, field: str, message: str) -> None:
        self.field, self.message = field, message
        super().__init__(f"{field}: {message}")


def spec_sections() -> dict[str, type]:
    """Each family's spec section (`<package>.spec.SECTION`), by name: pydantic only, no torch."""
    return {name: importlib.import_module(f"{package}.spec").SECTION for name, package in FAMILIES.items()}


def resolve_section(section: Any) -> Any:
    """A spec's `model:` section with what it refers to read (a checkpoint folder's config:
    fields filled, contradictions raised as specs.base.FieldIssues at their field). Runs the
    family's `spec.RESOLVER` where it names one: no torch."""
    resolver = getattr(importlib.import_module(f"{FAMILIES[section.family]}.spec"), "RESOLVER", None)
    if resolver is None:
        return section
    module, _, function = resolver.partition(":")
    return getattr(importlib.import_module(module), function)(section)


def family(name: str) -> ModelFamily:
    """The family registered as `name` (imports its module: torch, never the planner)."""
    if name not in FAMILIES:
        raise KeyError(f"unknown model family {name!r}; known: {', '.join(FAMILIES)}")
    return importlib.import_module(f"{FAMILIES[name]}.family").FAMILY


def family_of(section: Any) -> ModelFamily:
    """The family of a spec's `model` section."""
    return family(section.family)
