"""The planner's graph of a Llama is the Llama the trainer runs: the same parameters, the same
matmul and attention FLOPs as torch counts them, and the activation memory autograd keeps (to 4
bytes), in bf16 and fp32, for the whole batch and a data-parallel share."""

from __future__ import annotations

import pytest
import torch
from parashift.models import family
from parashift.models.llama.graph import build
from parashift.models.llama.spec import LlamaSpec
from parashift.planner.costs import data_parallel_activation_bytes
from parashift.trainer.memory import kept_for_backward
from torch.utils.flop_counter import FlopCounterMode, register_flop_formula

LLAMA = family("llama")
SPECS = {
    "gqa": LlamaSpec(family="llama", n_layers=2, d_model=48, n_heads=8, n_kv_heads=4, ffn_dim=80, vocab_size=256,
                     seq_len=24),
    "mha-tied-biased": LlamaSpec(family="llama", n_layers=1, d_model=32, n_heads=4, vocab_size=300, seq_len=20,
                                 tie_embeddings=True, attention_bias=True, output_bias=True),
}


@register_flop_formula(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu)
def _cpu_flash_attention(query: tuple[int, ...], key: tuple[int, ...], *args: object, **kwargs: object) -> int:
    """torch counts no FLOPs for the CPU flash kernel: QK^T and PV, 2 FLOPs per multiply-add."""
    b, h, s, e = query
    return 2 * 2 * b * h * s * key[2] * e


@pytest.mark.parametrize("name", list(SPECS))
def test_parameters_and_flops_are_the_models(name: str) -> None:
    spec = SPECS[name]
    model = LLAMA.build(spec)
    graph = build(spec, 3, "fp32")
    assert graph.n_params == sum(p.numel() for p in model.parameters())
    tokens = torch.randint(0, spec.vocab_size, (3, spec.seq_len))
    with FlopCounterMode(display=False) as counter:
        model(tokens)
    gemm_flops = sum(op.flops for op in graph.ops if op.kind in ("matmul", "attention"))
    assert gemm_flops == counter.get_total_flops()


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_planned_activation_memory_is_what_autograd_keeps(name: str, precision: str) -> None:
    spec = SPECS[name]
    model = LLAMA.build(spec)
    generator = torch.Generator().manual_seed(0)
    for batch, dp in ((4, 1), (2, 2)):  # the whole batch, and a data-parallel share of it
        tokens, targets = torch.randint(0, spec.vocab_size, (2, batch, spec.seq_len), generator=generator)
        kept = kept_for_backward(model, tokens, targets, precision)
        planned = data_parallel_activation_bytes(build(spec, 4, precision), dp)
        assert abs(planned - kept) <= 4, (planned, kept)
