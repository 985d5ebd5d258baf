"""The GPT family (GPT-2 style): models/gpt/model.py, registered as `gpt`."""

from __future__ import annotations

from typing import Any

import torch
from parashift.models.base import ModelFamily
from parashift.models.gpt import hf
from parashift.models.gpt.model import GPT, GPTConfig, initial_value
from parashift.models.gpt.spec import GPTSpec
from parashift.models.sharding import Region, ShardingTable
from torch import nn

SHARDING = ShardingTable(
    regions=(
        Region("attention", "attn", colwise=("q_proj", "k_proj", "v_proj"), rowwise="out_proj", split_inside=True),
        Region("mlp", "mlp", colwise=("up_proj",), rowwise="down_proj"),
    ),
    stream_dropouts=("attn.resid_dropout", "mlp.dropout"),
    first_stage=("tok_emb", "pos_emb", "drop"),
)


class GPTFamily(ModelFamily):
    name = "gpt"
    sharding = SHARDING
    graph_builder = "parashift.models.gpt.graph:build"

    def build(self, spec: GPTSpec) -> nn.Module:
        return GPT(GPTConfig.of(spec))

    def initial_value(self, spec: GPTSpec, name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
        return initial_value(GPTConfig.of(spec), name, shape, seed)

    def hf_adapter(self) -> Any:
        return hf


FAMILY = GPTFamily()
