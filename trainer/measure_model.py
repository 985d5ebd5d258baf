"""Measure a family's model in one process for the planner's measured profile
(planner/measured.py): what a model without an op graph is planned from."""

from __future__ import annotations

import functools
import gc
import time
from fractions import Fraction
from typing import Any

import torch
from parashift.models import family_of
from parashift.models.layers import token_loss_sum
from parashift.trainer.memory import alive_parts, kept_parts
from parashift.trainer.recompute import CHECKPOINTED, checkpointed_call

_DEPTH_FIELDS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
_TOKEN_FIELDS = ("pad_token_id", "bos_token_id", "eos_token_id")
_SMALL_VOCAB = 256


# The sequence lengths what autograd keeps is measured at for a longer context (`kept_at`).
PROBE_LENGTHS = (16, 32, 48)


def measure_for_gpus(model_spec: Any, precision: str, seed: int = 0, modes: tuple[str, ...] = ("none",),
                     probe_lengths: tuple[int, int, int] = PROBE_LENGTHS) -> dict[str, Any]:
    """What the planner needs of a model that trains on GPUs, without building it whole on the
    flow's CPU (8B parameters are 32 GB of fp32 there, and one forward and backward on one thread
    half an hour): its parameters counted on the meta device, and the bytes autograd keeps for a
    sequence measured on small copies (1 and 2 decoder layers, a vocabulary of 256 and 512: every
    layer keeps the same, and the logits and loss keep bytes in proportion to the vocabulary),
    extended to its depth and vocabulary, and on short sequences extended to its context
    (`kept_at`). Its seconds are its FLOPs at the device's rate (`planner.measured`), not measured."""
    family = family_of(model_spec)
    with torch.device("meta"):
        model = family.build(model_spec)
    layers = [sum(p.numel() for p in layer.parameters()) for _, layer in family.layers(model)]
    n_params = sum(p.numel() for p in model.parameters())
    vocab = model_spec.vocab_size or model.get_output_embeddings().weight.shape[0]
    return {"sequence_s": float("nan"), **activations(model_spec, len(layers), vocab, precision, seed, modes,
                                                      probe_lengths),
            "n_params": n_params, "layer_params": max(layers, default=0), "root_params": n_params - sum(layers),
            "flops_per_token": family.flops_per_token(model_spec, n_params)}


def activations(model_spec: Any, depth: int, vocab: int, precision: str, seed: int, modes: tuple[str, ...] = ("none",),
                probe_lengths: tuple[int, int, int] = PROBE_LENGTHS) -> dict[str, Any]:
    """What one sequence keeps under each checkpointing mode (`activation_bytes`: none;
    `activation_bytes_by_ac`), what a forward keeps once whatever its batch (`cast_bytes`,
    `cast_bytes_by_ac`: autocast's weight copies), and what one decoder layer keeps of both
    (`layer_kept_by_ac`: a checkpointed layer holds its whole again while its backward runs),
    from small copies (1 and 2 layers, 256 and 512 ids) extended to `depth` layers and `vocab` ids."""
    lengths = probe_lengths_for(model_spec, probe_lengths)
    window = min(lengths) // 2 if len(lengths) > 1 else None  # shorter than every probe, where they are extended
    one, two, wide = (kept_at(_small_copy(model_spec, layers, width, window), precision, seed, lengths, modes)
                      for layers, width in ((1, _SMALL_VOCAB), (2, _SMALL_VOCAB), (1, 2 * _SMALL_VOCAB)))
    kept = {mode: one[mode] + (depth - 1) * (two[mode] - one[mode])
            + (vocab - _SMALL_VOCAB) * (wide[mode] - one[mode]) // _SMALL_VOCAB for mode in one}
    measured = [mode for mode in kept if "/" not in mode]
    return {"activation_bytes": float(kept["none"]), "cast_bytes": float(kept["none/casts"]),
            "activation_bytes_by_ac": {mode: float(kept[mode]) for mode in measured if mode != "none"},
            "cast_bytes_by_ac": {mode: float(kept[f"{mode}/casts"]) for mode in measured if mode != "none"},
            "layer_kept_by_ac": {mode: float(two[mode] + two[f"{mode}/casts"] - one[mode] - one[f"{mode}/casts"])
                                 for mode in measured}}


def probe_lengths_for(model_spec: Any, probe_lengths: tuple[int, int, int]) -> tuple[int, ...]:
    """The lengths to measure at: the context itself where it is no longer than the probes, else
    the probes (on copies whose sliding window is shorter than them: `_small_copy`)."""
    return (model_spec.seq_len,) if model_spec.seq_len <= max(probe_lengths) else tuple(probe_lengths)


def _windows_shortened(model_spec: Any, config: dict[str, Any], window: int | None) -> dict[str, Any]:
    """`config` with each sliding window or attention chunk shorter than the context cut to
    `window`. Past its window a sequence's attention takes a mask (what it keeps changes there),
    and every probe must take that path as the context does; the mask is the sequence's square
    whatever the window, so a window shorter than the probes keeps what the model's keeps. The
    probes were moved past the window before: a Gemma 2 9B shape's window of 4,096 made its
    copies' forwards over 4,100 tokens run for more than 15 minutes."""
    if window is None:
        return config
    names = ("attention_chunk_size",) if config.get("use_sliding_window") is False else \
        ("sliding_window", "attention_chunk_size")
    shorter = {name: window for name in names
               if isinstance(config.get(name), int) and 0 < config[name] < model_spec.seq_len}
    return {**config, **shorter}


def kept_at(model_spec: Any, precision: str, seed: int, lengths: tuple[int, ...],
            modes: tuple[str, ...] = ("none",)) -> dict[str, int]:
    """Bytes one sequence of `model_spec.seq_len` tokens keeps under each activation checkpointing
    mode (`kept_by_mode`), measured at `lengths` (one: the context itself). Why three short ones
    are exact: every tensor a layer keeps has the sequence as one dim (activations) or two
    (attention scores, masks, where kept), so what a sequence keeps is a quadratic in its
    length, fixed by three points (Lagrange's form, in integers); `tests/test_planner_measured.py`
    checks it against the whole context. Why: the copies' layers are the model's own width, and
    a 7B-wide layer's forward over 4,096 tokens took minutes and 10 GB on the flow's CPU."""
    family = family_of(model_spec)
    model = family.build(model_spec)
    points = []
    for length in lengths:
        inputs, targets = _sequence(model_spec, model, 1, seed, length)
        points.append((length, kept_by_mode(family, model, inputs, targets, precision, modes)))
    del model
    gc.collect()  # a 7B-wide layer is a gigabyte (a model's modules may hold cycles): gone before the next copy
    if len(points) == 1:
        return points[0][1]
    return {mode: _quadratic_at(model_spec.seq_len, [(x, kept[mode]) for x, kept in points]) for mode in points[0][1]}


def _quadratic_at(target: int, points: list[tuple[int, int]]) -> int:
    """The polynomial through `points` (Lagrange's form, exact in integers) at `target`."""
    total = Fraction(0)
    for i, (x_i, y_i) in enumerate(points):
        term = Fraction(y_i)
        for j, (x_j, _) in enumerate(points):
            if j != i:
                term *= Fraction(target - x_j, x_i - x_j)
        total += term
    return round(total)


def kept_by_mode(family: Any, model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
                 precision: str, modes: tuple[str, ...] = ("none",)) -> dict[str, int]:
    """Bytes one forward of `inputs` keeps for backward under each checkpointing mode, in two
    parts: `mode` (what grows with the batch) and `mode/casts` (autocast's weight copies, once
    per forward). "none" as autograd saves them (`kept_parts`); "selective" and "full" by the
    difference every layer checkpointed makes to what the forward leaves alive (`alive_parts`:
    a checkpoint's own saved tensors are out of saved-tensor hooks' sight), the same checkpoints
    the trainer applies (trainer.recompute), each layer's forward run through them for the
    measurement only."""
    logits = _Logits(family, model)
    casts, rest = kept_parts(logits, inputs, targets, precision)
    out = {"none": rest, "none/casts": casts}
    checkpointed = [mode for mode in CHECKPOINTED if mode in modes]
    if not checkpointed:
        return out
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def alive() -> tuple[int, int]:
        autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")

        def forward() -> torch.Tensor:
            with autocast:
                return token_loss_sum(logits(inputs), targets)
        return alive_parts(forward, weights)

    plain_casts, plain = alive()
    layers = [layer for _, layer in family.layers(model)]
    for mode in checkpointed:
        for layer in layers:
            layer.forward = functools.partial(checkpointed_call, type(layer).forward.__get__(layer), mode)
        try:
            mode_casts, mode_rest = alive()
        finally:
            for layer in layers:
                del layer.forward
        out[mode], out[f"{mode}/casts"] = rest + mode_rest - plain, casts + mode_casts - plain_casts
    return out


def _small_copy(model_spec: Any, depth: int, vocab: int, window: int | None = None) -> Any:
    """The same model with `depth` decoder layers and a vocabulary of `vocab` (a per-layer list
    such as `layer_types` cut to match; special token ids, which may lie beyond it, dropped), and
    with `window`: its sliding windows shortened to it (`_windows_shortened`)."""
    config = {k: v for k, v in (model_spec.config or {}).items() if k not in _DEPTH_FIELDS + _TOKEN_FIELDS}
    if isinstance(config.get("layer_types"), list):
        config["layer_types"] = config["layer_types"][:depth]
    config = _windows_shortened(model_spec, config, window)
    return model_spec.model_copy(update={"config": {**config, "num_hidden_layers": depth, "vocab_size": vocab}})


class _Logits(torch.nn.Module):
    """The family's logits as a module holding the weights (what `kept_parts` calls)."""

    def __init__(self, family: Any, model: torch.nn.Module) -> None:
        super().__init__()
        self.family, self.inner = family, model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.family.logits(self.inner, tokens)


def _sequence(model_spec: Any, model: torch.nn.Module, batch: int, seed: int,
              length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`batch` sequences of `length` ids (default: the context) and their next-id targets."""
    vocab = model_spec.vocab_size or model.get_output_embeddings().weight.shape[0]  # transformers' default
    tokens = torch.randint(0, vocab, (batch, (length or model_spec.seq_len) + 1),
                           generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1], tokens[:, 1:]


def measure_model(model_spec: Any, micro_batch: int, precision: str, seed: int = 0, repeats: int = 3,
                  modes: tuple[str, ...] = ("none",)) -> dict[str, Any]:
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

        casts, kept = kept_parts(_Logits(family, model), inputs[:1], targets[:1], precision)
        layers = [sum(p.numel() for p in layer.parameters()) for _, layer in family.layers(model)]
        n_params = sum(p.numel() for p in model.parameters())
        vocab = model_spec.vocab_size or model.get_output_embeddings().weight.shape[0]
        del model
        checkpointing = activations(model_spec, len(layers), vocab, precision, seed, modes) if len(modes) > 1 else {}
    finally:
        torch.set_num_threads(threads)
    return {"sequence_s": best / micro_batch, **checkpointing, "activation_bytes": float(kept),
            "cast_bytes": float(casts), "n_params": n_params,
            "layer_params": max(layers, default=0), "root_params": n_params - sum(layers),
            "flops_per_token": family.flops_per_token(model_spec, n_params)}
