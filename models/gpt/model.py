"""A GPT decoder you can read in one sitting (after nanoGPT). Single-device code: nothing here
knows about processes, meshes or plans; `trainer.parallel` applies those from outside, through
the family's sharding table (models/gpt/__init__.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from parashift.models.layers import InputMajorLinear, seeded_normal
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    n_layers: int
    d_model: int
    n_heads: int
    vocab_size: int
    seq_len: int
    dropout: float = 0.0

    @classmethod
    def of(cls, fields: object) -> GPTConfig:
        """The config from anything that carries its fields by name (a spec's `model` section)."""
        return cls(**{name: getattr(fields, name) for name in cls.__dataclass_fields__})

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, seed: int = 0) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.head_dim = config.head_dim
        self.dropout = config.dropout
        self.q_proj = nn.Linear(config.d_model, config.d_model)
        self.k_proj = nn.Linear(config.d_model, config.d_model)
        self.v_proj = nn.Linear(config.d_model, config.d_model)
        self.out_proj = InputMajorLinear(config.d_model, config.d_model)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape  # (B, T, d)
        # Heads are read off the local width so a column-sharded projection (tensor parallel)
        # runs the same code with fewer local heads.
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        k = self.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )  # (B, nh, T, hs)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, d)
        return self.resid_dropout(self.out_proj(y))  # (B, T, d)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig, seed: int = 0) -> None:
        super().__init__()
        self.up_proj = nn.Linear(config.d_model, 4 * config.d_model)
        self.down_proj = InputMajorLinear(4 * config.d_model, config.d_model)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.down_proj(F.gelu(self.up_proj(x))))  # (B, T, d)


class Block(nn.Module):
    def __init__(self, config: GPTConfig, seed: int = 0) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.mlp_norm = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))  # (B, T, d)
        return x + self.mlp(self.mlp_norm(x))  # (B, T, d)


class GPT(nn.Module):
    """Token + position embeddings, n pre-norm blocks, a final norm and an untied LM head.

    The head is untied from the embedding so each weight has exactly one owner: simpler to
    slice in a parallel plan and to reshard. Blocks are keyed by layer index, so a pipeline
    stage is this same module with other stages' parts removed (`trainer.pipeline.build_stage`):
    without an embedding it takes hidden states, without a head it returns them.
    """

    def __init__(self, config: GPTConfig, seed: int = 0) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.seq_len, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleDict({str(i): Block(config) for i in range(config.n_layers)})
        self.norm = nn.LayerNorm(config.d_model)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if not self.lm_head.weight.is_meta:  # on the meta device there is nothing to fill yet
            self.reset_parameters(seed)

    def reset_parameters(self, seed: int = 0) -> None:
        """Every parameter's `initial_value` (whole, as this module holds them)."""
        with torch.no_grad():
            for name, param in self.named_parameters():
                param.copy_(initial_value(self.config, name, tuple(param.shape), seed))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok_emb is not None:  # x: (B, T) token ids
            pos = torch.arange(x.shape[1], device=x.device)  # (T,)
            x = self.drop(self.tok_emb(x) + self.pos_emb(pos))  # (B, T, d)
        for block in self.blocks.values():
            x = block(x)  # (B, T, d), or (B, T/tp, d) under sequence parallelism
        if self.lm_head is not None:
            x = self.lm_head(self.norm(x))  # (B, T, vocab)
        return x

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def initial_value(config: GPTConfig, name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Parameter `name`'s initial value, whole, on the CPU: GPT-2's initialisation (N(0, 0.02),
    residual projections scaled by 1/sqrt(2 n_layers), biases 0, norms 1), drawn from a
    generator seeded by the job's seed and the name. Why per name: a rank that holds part of a
    parameter under any plan fills its part from the same draw, one parameter at a time, so no
    rank ever builds the whole model, and every plan starts from the same weights."""
    if name.endswith("bias"):
        return torch.zeros(shape)
    if "norm" in name:
        return torch.ones(shape)
    std = 0.02 / math.sqrt(2 * config.n_layers) if name.endswith(("out_proj.weight", "down_proj.weight")) else 0.02
    return seeded_normal(name, shape, std, seed)
