"""The `hf` family's spec section: `model: {family: hf, config: {...}}` or `{family: hf, init_from: DIR}`."""

from __future__ import annotations

import difflib
from typing import Any, ClassVar, Literal, Self

from parashift.models import ModelUnbuildable
from parashift.specs.base import Section, raise_if
from pydantic import Field, model_validator

# Where a transformers config keeps its number of positions, by model type's naming.
POSITION_FIELDS = ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len")


class HFSpec(Section):
    """Any `transformers` causal LM (AutoModelForCausalLM), from a config or a checkpoint folder."""

    sharded: ClassVar[bool] = False  # data parallelism (dp, FSDP, HSDP) only: no sharding table

    family: Literal["hf"] = Field(description="Model family: gpt, llama or hf.")
    config: dict[str, Any] | None = Field(
        None, description="A transformers config as a mapping (model_type and its fields): random initialisation. "
                          "With init_from: read from its config.json (fields given here must agree).")
    init_from: str | None = Field(
        None, description="A Hugging Face checkpoint folder or fsspec URL (config.json + *.safetensors) to start from.")
    seq_len: int = Field(64, ge=2, le=1 << 20, description="Context length in tokens.")
    attn_implementation: Literal["auto", "sdpa", "eager"] = Field(
        "auto", description="transformers' attention kernel: auto is transformers' own choice (sdpa where the "
                            "architecture has it, else eager: Gemma 2 has no sdpa).")

    @model_validator(mode="after")
    def _one_source(self) -> Self:
        if self.config is None and self.init_from is None:
            raise_if([(("config",), "give model.config (a transformers config) or model.init_from (a checkpoint "
                                    "folder, whose config.json it then reads)")])
        if self.config is not None and not isinstance(self.config.get("model_type"), str):
            raise_if([(("config", "model_type"), "a transformers config needs its model_type (e.g. llama, gpt2)")])
        return self

    def _field(self, *names: str) -> Any:
        config = self.config or {}
        for name in names:
            if name in config:
                return config[name]
        return None

    @property
    def attention(self) -> str | None:
        """The kernel to ask transformers for (None: its own choice)."""
        return None if self.attn_implementation == "auto" else self.attn_implementation

    @property
    def tag(self) -> str:
        """The model's kind in a few characters (run tags)."""
        return f"hf-{(self.config or {}).get('model_type', 'folder')}"

    @property
    def vocab_size(self) -> int | None:
        """The config's vocabulary; None where it leaves it to transformers' default."""
        value = self._field("vocab_size")
        return None if value is None else int(value)

    @property
    def n_layers(self) -> int:
        return int(self._field("num_hidden_layers", "n_layer", "num_layers") or 0)

    @property
    def d_model(self) -> int:
        return int(self._field("hidden_size", "n_embd", "d_model") or 0)

    @property
    def attention_width(self) -> int:
        """Heads x head size, what attention's score and value GEMMs run over: the width where a
        config says no head size (Gemma 2 9B: 16 x 256 = 4,096 beside a width of 3,584)."""
        heads, size = self._field("num_attention_heads", "n_head", "num_heads"), self._field("head_dim")
        return int(heads) * int(size) if isinstance(heads, int) and isinstance(size, int) else self.d_model

    def plan_refusals(self, plan: Any) -> list[str]:
        """Why this model cannot run `plan` beyond data parallelism's checks: a sequence longer
        than its positions. The limit is the config's own, or its class's default (transformers
        is imported only then: a node's launcher checking a plan pays nothing for it otherwise)."""
        limit = next((int(v) for name in POSITION_FIELDS if isinstance(v := self._field(name), int)), None)
        if limit is None and self.config is not None:
            limit = max_positions(transformers_config(self))
        return [f"seq_len {self.seq_len} is longer than the model's {limit} positions"] \
            if limit is not None and self.seq_len > limit else []


def transformers_config(spec: HFSpec) -> Any:
    """The transformers config the spec names (its `config` mapping; `resolve` fills it from an
    `init_from` folder)."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    fields = dict(spec.config or {})
    model_type = fields.pop("model_type")
    if model_type not in CONFIG_MAPPING_NAMES:
        near = difflib.get_close_matches(model_type, list(CONFIG_MAPPING_NAMES), n=3)
        raise ModelUnbuildable("model.config.model_type", f"transformers knows no model type {model_type!r}"
                                                          + (f" (did you mean {' or '.join(near)}?)" if near else ""))
    try:
        return AutoConfig.for_model(model_type, **fields)
    except Exception as error:  # noqa: BLE001 - a config's checks raise many kinds (huggingface_hub's own among them)
        raise ModelUnbuildable("model.config", f"transformers refuses it: {_first_line(error)}") from error


def unbuildable(spec: HFSpec, error: Exception) -> ModelUnbuildable:
    """What a spec should change when transformers cannot build its model from its config, in
    one line (transformers' own errors run to a traceback)."""
    said = _first_line(error)
    model_type = (spec.config or {}).get("model_type", "this checkpoint's")
    if "attention implementation" in said:
        return ModelUnbuildable("model.attn_implementation", f"{said.split('. Please')[0]}: use auto (transformers' "
                                                             "choice) or eager")
    if "Unrecognized configuration class" in said:
        return ModelUnbuildable("model.config.model_type", f"{model_type!r} is not a causal LM in transformers "
                                                           "(AutoModelForCausalLM has no class for it)")
    return ModelUnbuildable("model.config", f"transformers cannot build it: {said}")


def _first_line(error: BaseException) -> str:
    """The innermost cause's first line: a validator's own words, not the wrapper's."""
    while error.__cause__ is not None:
        error = error.__cause__
    text = str(error).strip().splitlines()
    return text[0][:300] if text else type(error).__name__


def max_positions(config: Any) -> int | None:
    for name in POSITION_FIELDS:
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


SECTION = HFSpec
# What reads an `init_from` folder's config into the section ("module:function", no torch).
RESOLVER = "parashift.models.hf.resolve:resolve"
