"""The `hf` family: any `transformers` causal LM (AutoModelForCausalLM), data parallel only.

The model is `transformers`' own module, so its parameter names are its checkpoint's names
(export is a copy; `init_from` reads each parameter by its name). Decoder layers for FSDP2 are
the modules whose class the model lists in `_no_split_modules` (what accelerate's FSDP
auto-wrap uses), in order. `transformers` is imported only here, by the processes of an `hf`
job.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
from parashift.models.base import ModelFamily
from parashift.models.hf.spec import HFSpec, transformers_config, unbuildable
from parashift.models.hub import CheckpointUnreadable, checkpoint_weights
from parashift.models.layers import box_index, seeded_normal
from torch import nn


class HFFamily(ModelFamily):
    name = "hf"
    sharding = None  # data parallelism (dp, FSDP, HSDP) only

    def build(self, spec: HFSpec) -> nn.Module:
        from transformers import AutoModelForCausalLM

        config = transformers_config(spec)
        try:
            model = AutoModelForCausalLM.from_config(config, attn_implementation=spec.attention)
        except (ValueError, TypeError) as error:
            raise unbuildable(spec, error) from error
        return model.float()

    def initial_value(self, spec: HFSpec, name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
        """From `init_from` by name; else matrices N(0, initializer_range) drawn per name,
        vectors: weights 1 (norms), biases 0 (transformers' own initialisation in kind)."""
        if spec.init_from is not None:
            tensor = checkpoint_weights(spec.init_from).get(name).float()
            if tuple(tensor.shape) != tuple(shape):
                raise CheckpointUnreadable(f"{spec.init_from}: {name} is {list(tensor.shape)}, the model needs {list(shape)}")
            return tensor
        if len(shape) >= 2:
            std = float((spec.config or {}).get("initializer_range", 0.02))
            return seeded_normal(name, shape, std, seed)
        return torch.ones(shape) if name.endswith("weight") else torch.zeros(shape)

    def initial_part(self, spec: HFSpec, name: str, shape: tuple[int, ...], box: Any, seed: int) -> torch.Tensor:
        if spec.init_from is None:
            return self.initial_value(spec, name, shape, seed)[box_index(box)]
        weights = checkpoint_weights(spec.init_from)
        if weights.shape(name) != tuple(shape):
            raise CheckpointUnreadable(f"{spec.init_from}: {name} is {list(weights.shape(name))}, the model needs {list(shape)}")
        return weights.part(name, box_index(box)).float().contiguous()

    def initial_buffers(self, spec: HFSpec) -> dict[str, torch.Tensor]:
        """transformers' buffers (rotary inverse frequencies, causal masks) as its constructor
        computes them, built with every parameter sent to the meta device as it is registered
        (accelerate's init_empty_weights, which transformers 5 no longer ships)."""
        with _parameters_on_meta():
            model = self.build(spec)
        return {name: buffer.clone() for name, buffer in model.named_buffers()}

    def layers(self, model: nn.Module) -> Iterator[tuple[int, nn.Module]]:
        kinds = set(getattr(model, "_no_split_modules", None) or ())
        found = [m for m in model.modules() if type(m).__name__ in kinds]
        if not found:
            raise ValueError(f"{type(model).__name__} names no decoder layer class (_no_split_modules)")
        yield from enumerate(found)

    def logits(self, module: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        return module(input_ids=tokens, use_cache=False).logits

    def flops_per_token(self, spec: HFSpec, n_params: int) -> int:
        """As every family's, with a mixture of experts' experts counted at the share of them each
        token is routed through (k of E): Qwen3-30B-A3B's 30.5B parameters are 3.35B a token,
        and counting all of them made its GPU step estimate 9x too long and its MFU 9x too high.
        Attention's scores over the heads' width, which need not be the model's."""
        idle = _idle_expert_params(spec.model_dump_json()) if n_params else 0
        return 6 * (n_params - idle) + 12 * spec.n_layers * spec.attention_width * spec.seq_len

    def hf_adapter(self) -> Any:
        return _SameNames


# Where a transformers config keeps its number of routed experts and how many a token takes.
_EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")


@functools.lru_cache(maxsize=8)
def _idle_expert_params(spec_json: str) -> int:
    """Parameters of a mixture of experts' routed experts that a token does not pass through:
    those under a module named `experts` (shared experts, named otherwise, see every token),
    times (E - k) / E. Zero for a dense model (no build); a sparse one is built on the meta
    device once per process (seconds for a 30B shape)."""
    spec = HFSpec.model_validate_json(spec_json)
    config = transformers_config(spec)
    routed = getattr(config, "num_experts_per_tok", None)
    experts = next((value for name in _EXPERT_COUNTS if isinstance(value := getattr(config, name, None), int)), None)
    if not isinstance(routed, int) or not experts or not 0 < routed < experts:
        return 0
    model = FAMILY.build_on_meta(spec)
    in_experts = sum(p.numel() for name, p in model.named_parameters() if "experts" in name.split("."))
    return in_experts * (experts - routed) // experts


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None:
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


class _SameNames:
    """The `hf` family's parameters already carry their checkpoint names."""

    @staticmethod
    def hf_name(name: str) -> tuple[str, bool]:
        return name, False

    @staticmethod
    def hf_config(spec: HFSpec) -> dict[str, Any]:
        config = transformers_config(spec)
        if not getattr(config, "architectures", None):
            from transformers import AutoModelForCausalLM

            config.architectures = [AutoModelForCausalLM._model_mapping[type(config)].__name__]
        return config.to_dict()


FAMILY = HFFamily()
