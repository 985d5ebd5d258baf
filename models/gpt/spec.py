"""The GPT family's spec section: `model: {family: gpt, ...}` (a `model:` without `family`)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal, Self

from parashift.specs.base import Section, raise_if
from pydantic import Field, model_validator


class GPTSpec(Section):
    """A GPT-2 style decoder: learned positions, LayerNorm, GELU MLP, untied head."""

    sharded: ClassVar[bool] = True  # the family has a sharding table: tp and pp as well as dp

    family: Literal["gpt"] = Field("gpt", description="Model family: gpt (the default), llama or hf.")
    n_layers: int = Field(2, ge=1, le=1024, description="Number of transformer blocks.")
    d_model: int = Field(64, ge=8, le=65536, description="Width of the residual stream.")
    n_heads: int = Field(4, ge=1, le=1024, description="Attention heads per block; must divide d_model.")
    vocab_size: int = Field(256, ge=2, le=1 << 20, description="Number of token ids (>= 256 for the bytes tokenizer).")
    seq_len: int = Field(64, ge=2, le=1 << 20, description="Context length in tokens.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout probability in [0, 1).")

    @model_validator(mode="after")
    def _heads_divide_width(self) -> Self:
        if self.d_model % self.n_heads:
            raise_if([(("d_model",), f"must be divisible by model.n_heads ({self.d_model} % {self.n_heads} != 0)")])
        return self

    @property
    def n_kv_heads(self) -> int:
        return self.n_heads

    @property
    def tag(self) -> str:
        """The model's shape in a few characters (run tags)."""
        return f"{self.n_layers}x{self.d_model}"

    def plan_refusals(self, plan: Any) -> list[str]:
        """Why this model cannot run `plan` beyond the generic checks: never (a head of its own)."""
        return []


SECTION = GPTSpec
