"""The planner's graph of a GPT job (imported by the planner's side only)."""

from __future__ import annotations

from models.gpt.spec import GPTSpec
from planner.builders import gpt_graph
from planner.graph import Graph


def build(spec: GPTSpec, batch: int, precision: str) -> Graph:
    return gpt_graph(spec.n_layers, spec.d_model, spec.n_heads, spec.vocab_size, spec.seq_len, batch,
                     precision=precision)
