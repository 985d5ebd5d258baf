"""Our parameter names onto a Hugging Face architecture's, for the families' adapters
(models/llama/hf.py, models/gpt/hf.py): the whole model's names one to one, and the names inside
block i (`blocks.i.<inner>`) under the architecture's prefix of layer i, each with whether the
tensor is held transposed there (our row-parallel weights are input-major: models/layers.py)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

_BLOCK = re.compile(r"blocks\.(\d+)\.(.+)")


@dataclass(frozen=True)
class NameMap:
    outside: Mapping[str, str]  # ours -> theirs, outside the blocks (never transposed)
    inside: Mapping[str, tuple[str, bool]]  # ours inside a block -> (theirs inside a layer, transposed?)
    layers: str  # their prefix of layer i: "model.layers", "model.decoder.layers"

    def __call__(self, name: str) -> tuple[str, bool]:
        """Our parameter name -> (the Hugging Face name, whether the tensor is held transposed)."""
        if name in self.outside:
            return self.outside[name], False
        match = _BLOCK.fullmatch(name)
        if match is None or match.group(2) not in self.inside:
            raise KeyError(f"{name} has no Hugging Face name")
        inner, transposed = self.inside[match.group(2)]
        return f"{self.layers}.{match.group(1)}.{inner}", transposed
