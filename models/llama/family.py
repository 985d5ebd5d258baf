"""The Llama family: its sharding table and what the trainer asks of it."""

from __future__ import annotations

from typing import Any

import torch
from parashift.models.base import ModelFamily
from parashift.models.layers import box_index
from parashift.models.llama import hf
from parashift.models.llama.model import Llama, initial_value
from parashift.models.llama.spec import LlamaSpec
from parashift.models.sharding import Region, ShardingTable
from torch import nn

SHARDING = ShardingTable(
    regions=(
        # Query and key/value projections split by heads: tp must divide the kv heads too.
        Region("attention", "attn", colwise=("q_proj", "k_proj", "v_proj"), rowwise="out_proj", split_inside=True),
        Region("mlp", "mlp", colwise=("gate_proj", "up_proj"), rowwise="down_proj"),
    ),
    stream_dropouts=("attn.resid_dropout", "mlp.dropout"),
    first_stage=("tok_emb", "drop"),
)


class LlamaFamily(ModelFamily):
    name = "llama"
    sharding = SHARDING
    graph_builder = "parashift.models.llama.graph:build"

    def build(self, spec: LlamaSpec) -> nn.Module:
        return Llama(spec)

    def initial_value(self, spec: LlamaSpec, name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
        if spec.init_from is not None:
            return hf.part_from_checkpoint(spec, name, shape, tuple(slice(None) for _ in shape))
        return initial_value(spec, name, shape, seed)

    def initial_part(self, spec: LlamaSpec, name: str, shape: tuple[int, ...], box: Any, seed: int) -> torch.Tensor:
        if spec.init_from is not None:
            return hf.part_from_checkpoint(spec, name, shape, box_index(box))
        return initial_value(spec, name, shape, seed)[box_index(box)]

    def flops_per_token(self, spec: LlamaSpec, n_params: int) -> int:
        return 6 * n_params + 12 * spec.n_layers * spec.n_heads * spec.hd * spec.seq_len

    def hf_adapter(self) -> Any:
        return hf


FAMILY = LlamaFamily()
