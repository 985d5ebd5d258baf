"""What parashift asks of a model family: one object per family, registered in `models`.

Everything else (worker, layouts, pipeline stages, the planner's profile, preflight) reaches a
model only through these methods, given the spec's `model:` section.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Any

import torch
from parashift.models.layers import box_index
from parashift.models.sharding import ShardingTable
from torch import nn
from torch.overrides import TorchFunctionMode

# In-place fills a module's default initialisation calls (`nn.init.*`, `Tensor.normal_` ...).
_FILLS = frozenset({"normal_", "uniform_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
                    "xavier_normal_", "orthogonal_", "ones_", "zeros_", "constant_", "fill_", "zero_"})


class _NoFillsOnMeta(TorchFunctionMode):
    """Skips in-place fills of meta tensors: there is nothing to fill, and meta's kernels for the
    random ones import torch._dynamo (0.9 s of CPU measured) in processes that never need it
    otherwise: the flow's, which builds models on meta to count and place their parameters."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__name__", None) in _FILLS:
            target = args[0] if args else kwargs.get("tensor")
            if isinstance(target, torch.Tensor) and target.is_meta:
                return target
        return func(*args, **kwargs)


class ModelFamily:
    """A family of single-device decoder modules and what parallelizes them.

    `sharding` None: the family runs data parallelism only (replicated, FSDP, HSDP), layer by
    layer as `layers` gives them.
    """

    name: str
    sharding: ShardingTable | None = None
    graph_builder: str | None = None  # "module:function" building the planner's graph (planner side only)

    def build(self, spec: Any) -> nn.Module:
        """The whole model on the current default device (the meta device builds no memory);
        parameters uninitialised where the device is meta."""
        raise NotImplementedError

    def build_on_meta(self, spec: Any) -> nn.Module:
        """`build` on the meta device: shapes, names and dtypes, no memory, no initialisation."""
        with torch.device("meta"), _NoFillsOnMeta():
            return self.build(spec)

    def initial_value(self, spec: Any, name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
        """Parameter `name`'s initial value, whole, on the CPU: the same under every plan."""
        raise NotImplementedError

    def initial_part(self, spec: Any, name: str, shape: tuple[int, ...], box: Any, seed: int) -> torch.Tensor:
        """The `box` (a ptc Slice: offsets, lengths) of parameter `name`'s initial value: what
        one rank holds. Default: cut from the whole value; a family reading a checkpoint reads
        just the box."""
        return self.initial_value(spec, name, shape, seed)[box_index(box)]

    def flops_per_token(self, spec: Any, n_params: int) -> int:
        """Training FLOPs per token: 6 per parameter plus attention scores (PaLM appendix B; the
        convention torchtitan's MFU uses)."""
        return 6 * n_params + 12 * spec.n_layers * spec.d_model * spec.seq_len

    def layers(self, model: nn.Module) -> Iterator[tuple[int, nn.Module]]:
        """(index, decoder layer) of `model` or of a pipeline stage holding some of its layers."""
        assert self.sharding is not None, f"family {self.name} must say where its layers are"
        for name, layer in getattr(model, self.sharding.layers).named_children():
            yield int(name), layer

    def initial_buffers(self, spec: Any) -> dict[str, torch.Tensor]:
        """Buffers (not parameters, not checkpointed) a model built on the meta device lacks
        after `to_empty`, by name, on the CPU: a rotary table, say. Default: none."""
        return {}

    def logits(self, module: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        """(B, T) token ids -> (B, T, vocab) logits through `module` (the model or its wrapper)."""
        return module(tokens)

    def hf_adapter(self) -> Any:
        """The family's Hugging Face adapter (a module with `hf_name(name) -> (hf name,
        transposed)`, `hf_config(spec) -> dict` and, where a tensor changes beyond that,
        `hf_tensor(name, tensor) -> tensor`), or None."""
        return None

    def graph(self, spec: Any, batch: int, precision: str) -> Any:
        """The planner's op graph of this model for one global batch (imports the planner)."""
        if self.graph_builder is None:
            raise NotImplementedError(f"the {self.name} family has no planner graph")
        module, _, function = self.graph_builder.partition(":")
        return getattr(importlib.import_module(module), function)(spec, batch, precision)
