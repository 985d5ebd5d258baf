"""The planner's graph of a GPT job (imported by the planner's side only)."""

from __future__ import annotations

from parashift.models.gpt.spec import GPTSpec
from parashift.planner.builders import gpt_graph
from parashift.planner.graph import Graph


def build(spec: GPTSpec, batch: int, precision: str) -> Graph:
    return gpt_graph(spec.n_layers, spec.d_model, spec.n_heads, spec.vocab_size, spec.seq_len, batch,
                     precision=precision)
