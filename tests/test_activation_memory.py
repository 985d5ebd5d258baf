"""The planner's activation memory is what the trainer's autograd really keeps.

Measured by `trainer.memory.kept_for_backward` (every tensor autograd saves for backward, once
per storage, parameters left out) for the trainer's GPT run as the worker runs it (bf16
autocast over fp32 weights, or plain fp32). The planner's count
for the same batch is each op's `saved` tensors plus autocast's weight copies
(`planner.costs.OpCost.act_mem`, `cast_mem`).
"""

from __future__ import annotations

import pytest
import torch
from parashift.models.gpt.model import GPT, GPTConfig
from parashift.planner.builders import gpt_graph
from parashift.planner.costs import data_parallel_activation_bytes
from parashift.trainer.memory import kept_for_backward

CONFIG = GPTConfig(n_layers=2, d_model=64, n_heads=4, vocab_size=256, seq_len=32)


def kept_by_autograd(model: GPT, batch: int, precision: str) -> int:
    """Bytes autograd keeps for one forward of `batch` random sequences."""
    generator = torch.Generator().manual_seed(0)
    tokens, targets = torch.randint(0, CONFIG.vocab_size, (2, batch, CONFIG.seq_len), generator=generator)
    return kept_for_backward(model, tokens, targets, precision)


def planned(batch: int, precision: str, dp: int = 1) -> float:
    """The planner's bytes per device for `batch` sequences split `dp` ways."""
    graph = gpt_graph(CONFIG.n_layers, CONFIG.d_model, CONFIG.n_heads, CONFIG.vocab_size, CONFIG.seq_len, batch,
                      precision=precision)
    return data_parallel_activation_bytes(graph, dp)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_planned_activation_memory_is_what_autograd_keeps(precision: str) -> None:
    model = GPT(CONFIG)
    measured = kept_by_autograd(model, 4, precision)
    assert planned(4, precision) == pytest.approx(measured, rel=1e-3)
    # A data-parallel share keeps its share of the activations and the whole weight copies.
    assert planned(4, precision, dp=2) == pytest.approx(kept_by_autograd(model, 2, precision), rel=1e-3)


def test_bf16_keeps_fp32_norm_inputs_and_a_copy_per_projection() -> None:
    """The two effects Megatron's 34 bytes per token and d_model leave out are real: autocast
    keeps norm inputs in fp32 and q, k, v each keep their own bf16 copy of the norm output."""
    graph = gpt_graph(1, 1024, 16, 256, 128, 1)
    layer = [op for op in graph.ops if op.layer == 0]
    per_token_d = sum(t.bytes * op.numel(t.dims) for op in layer for t in op.saved or ()) / (128 * 1024)
    assert 40 <= per_token_d < 40.2  # 40 plus the per-row statistics of the norms and attention


# The inputs the caller holds (token ids and targets, int64): kept by the planner's count,
# never created by the forward, so `alive_after` leaves them out.
def _caller_held(batch: int, seq_len: int) -> int:
    return 2 * batch * seq_len * 8


@pytest.mark.parametrize("precision", ["bf16", "fp32", "bf16-parameters"])
@pytest.mark.parametrize("mode", ["none", "selective", "full"])
@pytest.mark.parametrize("family_name", ["gpt", "llama"])
def test_planned_checkpointed_activations_are_what_the_forward_leaves_alive(family_name: str, mode: str,
                                                                            precision: str) -> None:
    """Under each activation checkpointing mode (trainer.recompute on every layer), the bytes a
    forward and loss leave alive for backward (autograd's, the checkpoint's inputs, the
    selective policy's cache) are the planner's count for the checkpointed graph
    (planner.checkpointing), within 0.5%: bf16 autocast over fp32 parameters, fp32, and bf16
    parameters (FSDP2's mixed precision: the model in bf16, fp32 logits to the loss)."""
    import contextlib

    from parashift.models import family_of
    from parashift.models.layers import token_loss_sum
    from parashift.planner.checkpointing import checkpointed, with_precision
    from parashift.specs import JobSpec
    from parashift.trainer.memory import alive_after
    from parashift.trainer.recompute import apply_ac

    model_section = {"n_layers": 2, "d_model": 64, "n_heads": 4, "vocab_size": 256, "seq_len": 32}
    if family_name == "llama":
        model_section = {**model_section, "family": "llama", "n_kv_heads": 2, "ffn_dim": 96}
    spec = JobSpec.model_validate({"name": "memory", "model": model_section}).model
    family = family_of(spec)
    torch.manual_seed(0)
    model = family.build(spec)
    if precision == "bf16-parameters":
        model = model.to(torch.bfloat16)
    apply_ac([layer for _, layer in family.layers(model)], mode)
    batch = 4
    tokens, targets = torch.randint(0, spec.vocab_size, (2, batch, spec.seq_len))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()

    def forward() -> torch.Tensor:
        with autocast:
            return token_loss_sum(family.logits(model, tokens).float(), targets)

    alive = alive_after(forward) + _caller_held(batch, spec.seq_len)
    if precision == "bf16-parameters":
        graph = with_precision(family.graph(spec, batch, "bf16"), "fsdp")
    else:
        graph = family.graph(spec, batch, precision)
    assert data_parallel_activation_bytes(checkpointed(graph, mode)) == pytest.approx(alive, rel=5e-3)
