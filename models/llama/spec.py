"""The Llama family's spec section: `model: {family: llama, ...}`.

With `init_from` (a folder or fsspec URL holding a Hugging Face `config.json` and
`*.safetensors`), the shape fields come from the folder's config (models/llama/hf.py
`resolve`): the spec gives only what the folder does not hold (`seq_len`, `dropout`), and a
field that contradicts the config is an error.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, Self

from parashift.specs.base import Section, raise_if
from pydantic import Field, model_validator

# Llama's feed-forward width when none is given: 2/3 of 4 d (SwiGLU has three matrices where
# GPT's MLP has two), rounded up to a multiple of 256 (Meta's reference and torchtitan).
FFN_MULTIPLE_OF = 256


class Llama3RopeScaling(Section):
    """Llama 3.1's rotary frequency scaling (Hugging Face `rope_type: llama3`)."""

    rope_type: Literal["llama3"] = Field("llama3", description="The scaling rule (only llama3).")
    factor: float = Field(8.0, gt=0, description="How much longer the context is than the original.")
    low_freq_factor: float = Field(1.0, gt=0, description="Wavelengths beyond original / this are scaled by factor.")
    high_freq_factor: float = Field(4.0, gt=0, description="Wavelengths below original / this are kept.")
    original_max_position_embeddings: int = Field(8192, ge=1, description="The context the model was trained at.")

    @model_validator(mode="after")
    def _ordered(self) -> Self:
        if self.high_freq_factor <= self.low_freq_factor:
            raise_if([(("high_freq_factor",), f"must be > low_freq_factor ({self.high_freq_factor} <= "
                                              f"{self.low_freq_factor})")])
        return self


class LlamaSpec(Section):
    """A Llama-architecture decoder: RMSNorm, SwiGLU MLP, rotary embeddings, grouped-query attention."""

    sharded: ClassVar[bool] = True  # the family has a sharding table: tp and pp as well as dp

    family: Literal["llama"] = Field(description="Model family: gpt, llama or hf.")
    init_from: str | None = Field(
        None, description="A Hugging Face checkpoint folder or fsspec URL (config.json + *.safetensors) to start "
                          "from: its config gives the shape fields.")
    n_layers: int = Field(2, ge=1, le=1024, description="Number of decoder layers.")
    d_model: int = Field(64, ge=8, le=65536, description="Width of the residual stream.")
    n_heads: int = Field(4, ge=1, le=1024, description="Query heads per layer.")
    n_kv_heads: int | None = Field(
        None, ge=1, le=1024, description="Key/value heads (grouped-query attention); must divide n_heads. null: n_heads.")
    head_dim: int | None = Field(None, ge=1, le=4096, description="Width of a head (null: d_model / n_heads).")
    ffn_dim: int | None = Field(
        None, ge=1, le=1 << 20, description="Hidden width of the SwiGLU MLP (null: 8/3 d_model rounded up to 256).")
    vocab_size: int = Field(256, ge=2, le=1 << 20, description="Number of token ids.")
    seq_len: int = Field(64, ge=2, le=1 << 20, description="Context length in tokens.")
    norm_eps: float = Field(1e-5, gt=0, lt=1, description="RMSNorm epsilon.")
    rope_theta: float = Field(10000.0, gt=0, description="Rotary base (Llama 3: 500000).")
    rope_scaling: Llama3RopeScaling | None = Field(None, description="Llama 3.1 rotary scaling (null: none).")
    tie_embeddings: bool = Field(False, description="The head shares the token embedding's weight.")
    attention_bias: bool = Field(False, description="q, k and v projections have biases (Qwen2).")
    output_bias: bool = Field(False, description="The attention output projection has a bias.")
    mlp_bias: bool = Field(False, description="The MLP's projections have biases.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout probability in [0, 1).")

    @model_validator(mode="after")
    def _shape(self) -> Self:
        issues = []
        if self.n_kv_heads is not None and self.n_heads % self.n_kv_heads:
            issues.append((("n_kv_heads",), f"must divide model.n_heads ({self.n_heads} % {self.n_kv_heads} != 0)"))
        if self.head_dim is None and self.d_model % self.n_heads:
            issues.append((("d_model",), f"must be divisible by model.n_heads ({self.d_model} % {self.n_heads} != 0), "
                                         "or set model.head_dim"))
        if self.hd % 2:
            issues.append((("head_dim",), f"must be even for rotary embeddings (got {self.hd})"))
        raise_if(issues)
        return self

    @property
    def tag(self) -> str:
        """The model's shape in a few characters (run tags)."""
        return f"llama-{self.n_layers}x{self.d_model}"

    def plan_refusals(self, plan: Any) -> list[str]:
        """Why this model cannot run `plan` beyond the generic checks (`specs.plan.plan_refusals`):
        a head tied to the embedding must stay with it."""
        reasons = []
        if self.tie_embeddings and plan.degree("pp") > 1:
            reasons.append("a head tied to the embedding cannot sit on another pipeline stage than the embedding "
                           "(set model.tie_embeddings: false, or plan without pp)")
        if self.tie_embeddings and plan.degree("tp") > 1:
            regions = plan.tp_regions(self.n_layers)
            if regions.embed != regions.head:
                reasons.append("a head tied to the embedding must split the vocabulary over tp with it, or neither")
        return reasons

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def hd(self) -> int:
        """Width of one head."""
        return self.head_dim or self.d_model // self.n_heads

    @property
    def hidden(self) -> int:
        """Hidden width of the MLP."""
        if self.ffn_dim is not None:
            return self.ffn_dim
        return -(-int(8 * self.d_model / 3) // FFN_MULTIPLE_OF) * FFN_MULTIPLE_OF


SECTION = LlamaSpec
# What reads an `init_from` folder's config into the section ("module:function", no torch).
RESOLVER = "parashift.models.llama.hf:resolve"
