"""Measure a family's model in one process for the planner's measured profile
(planner/measured.py): what a model without an op graph is planned from."""

from __future__ import annotations

import time
from typing import Any

import torch
from parashift.models import family_of
from parashift.models.layers import token_loss_sum
from parashift.trainer.memory import kept_for_backward

_DEPTH_FIELDS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
_TOKEN_FIELDS = ("pad_token_id", "bos_token_id", "eos_token_id")
_SMALL_VOCAB = 256


def measure_for_gpus(model_spec: Any, precision: str, seed: int = 0) -> dict[str, float]:
    """What the planner needs of a model that trains on GPUs, without building it whole on the
    flow's CPU (8B parameters are 32 GB of fp32 there, and one forward and backward on one thread
    half an hour): its parameters counted on the meta device, and the bytes autograd keeps for a
    sequence measured on small copies (1 and 2 decoder layers, a vocabulary of 256 and 512: every
    layer keeps the same, and the logits and loss keep bytes in proportion to the vocabulary),
    extended to its depth and vocabulary. Its seconds are its FLOPs at the device's rate
    (`planner.measured`), not measured."""
    family = family_of(model_spec)
    with torch.device("meta"):
        model = family.build(model_spec)
    layers = [sum(p.numel() for p in layer.parameters()) for _, layer in family.layers(model)]
    n_params = sum(p.numel() for p in model.parameters())
    vocab = model_spec.vocab_size or model.get_output_embeddings().weight.shape[0]
    one, two, wide = (_kept(_small_copy(model_spec, depth, width), precision, seed)
                      for depth, width in ((1, _SMALL_VOCAB), (2, _SMALL_VOCAB), (1, 2 * _SMALL_VOCAB)))
    kept = one + (len(layers) - 1) * (two - one) + (vocab - _SMALL_VOCAB) * (wide - one) // _SMALL_VOCAB
    return {"sequence_s": float("nan"), "activation_bytes": float(kept), "n_params": n_params,
            "layer_params": max(layers, default=0), "root_params": n_params - sum(layers),
            "flops_per_token": family.flops_per_token(model_spec, n_params)}


def _small_copy(model_spec: Any, depth: int, vocab: int) -> Any:
    """The same model with `depth` decoder layers and a vocabulary of `vocab` (a per-layer list
    such as `layer_types` cut to match; special token ids, which may lie beyond it, dropped)."""
    config = {k: v for k, v in (model_spec.config or {}).items() if k not in _DEPTH_FIELDS + _TOKEN_FIELDS}
    if isinstance(config.get("layer_types"), list):
        config["layer_types"] = config["layer_types"][:depth]
    return model_spec.model_copy(update={"config": {**config, "num_hidden_layers": depth, "vocab_size": vocab}})


class _Logits(torch.nn.Module):
    """The family's logits as a module holding the weights (what `kept_for_backward` calls)."""

    def __init__(self, family: Any, model: torch.nn.Module) -> None:
        super().__init__()
        self.family, self.inner = family, model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.family.logits(self.inner, tokens)


def _sequence(model_spec: Any, model: torch.nn.Module, batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    vocab = model_spec.vocab_size or model.get_output_embeddings().weight.shape[0]  # transformers' default
    tokens = torch.randint(0, vocab, (batch, model_spec.seq_len + 1), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1], tokens[:, 1:]


def _kept(model_spec: Any, precision: str, seed: int) -> int:
    """Bytes autograd keeps for one sequence of the model."""
    family = family_of(model_spec)
    model = family.build(model_spec)
    inputs, targets = _sequence(model_spec, model, 1, seed)
    return kept_for_backward(_Logits(family, model), inputs, targets, precision)


def measure_model(model_spec: Any, micro_batch: int, precision: str, seed: int = 0, repeats: int = 3) -> dict[str, float]:
    """Seconds of one sequence's forward and backward (the best of `repeats` passes over a
    micro-batch, one thread as each CPU worker runs), bytes autograd keeps for one sequence,
    and the parameters of the model, of its largest decoder layer and outside its layers."""
    family = family_of(model_spec)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = family.build(model_spec)
        inputs, targets = _sequence(model_spec, model, micro_batch, seed)
        autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            with autocast:
                loss = token_loss_sum(family.logits(model, inputs), targets)
            loss.backward()
            best = min(best, time.perf_counter() - started)
            model.zero_grad(set_to_none=True)

        kept = kept_for_backward(_Logits(family, model), inputs[:1], targets[:1], precision)
        layers = [sum(p.numel() for p in layer.parameters()) for _, layer in family.layers(model)]
        n_params = sum(p.numel() for p in model.parameters())
    finally:
        torch.set_num_threads(threads)
    return {"sequence_s": best / micro_batch, "activation_bytes": float(kept), "n_params": n_params,
            "layer_params": max(layers, default=0), "root_params": n_params - sum(layers),
            "flops_per_token": family.flops_per_token(model_spec, n_params)}
