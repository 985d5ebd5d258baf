"""Measure a family's model in one process for the planner's measured profile
(planner/measured.py): what a model without an op graph is planned from."""

from __future__ import annotations

import time
from typing import Any

import torch
from parashift.models import family_of
from parashift.models.layers import token_loss_sum
from parashift.trainer.memory import kept_for_backward


def measure_model(model_spec: Any, micro_batch: int, precision: str, seed: int = 0, repeats: int = 3) -> dict[str, float]:
    """Seconds of one sequence's forward and backward (the best of `repeats` passes over a
    micro-batch, one thread as each CPU worker runs), bytes autograd keeps for one sequence,
    and the parameters of the model, of its largest decoder layer and outside its layers."""
    family = family_of(model_spec)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = family.build(model_spec)
        vocab = model_spec.vocab_size or model.get_output_embeddings().weight.shape[0]  # transformers' default
        tokens = torch.randint(0, vocab, (micro_batch, model_spec.seq_len + 1),
                               generator=torch.Generator().manual_seed(seed))
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            with autocast:
                loss = token_loss_sum(family.logits(model, inputs), targets)
            loss.backward()
            best = min(best, time.perf_counter() - started)
            model.zero_grad(set_to_none=True)

        class Logits(torch.nn.Module):  # kept_for_backward calls a module (holding the weights) on token ids
            def __init__(self) -> None:
                super().__init__()
                self.inner = model

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return family.logits(self.inner, x)

        kept = kept_for_backward(Logits(), inputs[:1], targets[:1], precision)
        layers = [sum(p.numel() for p in layer.parameters()) for _, layer in family.layers(model)]
        n_params = sum(p.numel() for p in model.parameters())
    finally:
        torch.set_num_threads(threads)
    return {"sequence_s": best / micro_batch, "activation_bytes": float(kept), "n_params": n_params,
            "layer_params": max(layers, default=0), "root_params": n_params - sum(layers),
            "flops_per_token": family.flops_per_token(model_spec, n_params)}
