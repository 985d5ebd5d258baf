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
