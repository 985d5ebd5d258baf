"""A Llama decoder you can read in one sitting: RMSNorm, SwiGLU MLP, rotary position embeddings
and grouped-query attention (Touvron et al. 2023; Llama 3, Qwen2 and Mistral share this math).

Single-device code, shaped like the GPT (models/gpt/model.py) so one sharding table describes
it: `tok_emb`, `drop`, `blocks.<i>` of (`attn_norm`, `attn`, `mlp_norm`, `mlp`), `norm`,
`lm_head`. Rotary embeddings follow Hugging Face's convention (rotate_half over two halves of
each head), so a Hugging Face checkpoint's q and k weights load as they are
(models/llama/hf.py); row-parallel weights are held input-major (models.layers.InputMajorLinear)
and transposed by the adapter.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from parashift.models.layers import InputMajorLinear, seeded_normal
from parashift.models.llama.spec import LlamaSpec
from torch import nn


class Rotary:
    """cos and sin of every position's rotation, per (length, device, dtype), computed once and
    shared by every layer. Not a module or a buffer: nothing to checkpoint or shard, and a model
    built on the meta device computes it on its real device at the first forward."""

    def __init__(self, spec: LlamaSpec) -> None:
        self.spec = spec
        self._cache: dict[tuple[int, torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def inverse_frequencies(self, device: torch.device) -> torch.Tensor:
        """(hd/2,) rotation rates: base^(-2i/hd), with Llama 3.1's scaling where the spec has it
        (as transformers' `_compute_llama3_parameters` computes it)."""
        hd = self.spec.hd
        inv = 1.0 / (self.spec.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64, device=device).float() / hd))
        s = self.spec.rope_scaling
        if s is None:
            return inv
        low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
        high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
        smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
        smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)

    def __call__(self, length: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        key = (length, device, dtype)
        if key not in self._cache:
            with torch.autocast(device.type, enabled=False):
                positions = torch.arange(length, device=device).float()  # (T,)
                freqs = torch.outer(positions, self.inverse_frequencies(device))  # (T, hd/2)
                angles = torch.cat((freqs, freqs), dim=-1)  # (T, hd)
                self._cache[key] = (angles.cos().to(dtype), angles.sin().to(dtype))
        return self._cache[key]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, nh, T, hd) rotated by position: each head's two halves as the plane of rotation."""
    half = x.shape[-1] // 2
    rotated_half = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # (B, nh, T, hd)
    return x * cos + rotated_half * sin


class Attention(nn.Module):
    def __init__(self, spec: LlamaSpec, rotary: Rotary) -> None:
        super().__init__()
        self.head_dim = spec.hd
        self.dropout = spec.dropout
        self.rotary = rotary
        self.q_proj = nn.Linear(spec.d_model, spec.n_heads * spec.hd, bias=spec.attention_bias)
        self.k_proj = nn.Linear(spec.d_model, spec.kv_heads * spec.hd, bias=spec.attention_bias)
        self.v_proj = nn.Linear(spec.d_model, spec.kv_heads * spec.hd, bias=spec.attention_bias)
        self.out_proj = InputMajorLinear(spec.n_heads * spec.hd, spec.d_model, bias=spec.output_bias)
        self.resid_dropout = nn.Dropout(spec.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape  # (B, T, d)
        # Heads are read off the local width: a column-sharded projection (tensor parallel)
        # holds nh/tp query and nkv/tp key/value heads, each query head still with its group's.
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nh, T, hd)
        k = self.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nkv, T, hd)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nkv, T, hd)
        cos, sin = self.rotary(T, x.device, q.dtype)  # (T, hd) each
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0,
                                           enable_gqa=q.shape[1] != k.shape[1])  # (B, nh, T, hd)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, nh * hd)
        return self.resid_dropout(self.out_proj(y))  # (B, T, d)


class SwiGLU(nn.Module):
    def __init__(self, spec: LlamaSpec) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(spec.d_model, spec.hidden, bias=spec.mlp_bias)
        self.up_proj = nn.Linear(spec.d_model, spec.hidden, bias=spec.mlp_bias)
        self.down_proj = InputMajorLinear(spec.hidden, spec.d_model, bias=spec.mlp_bias)
        self.dropout = nn.Dropout(spec.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)))  # (B, T, d)


class Block(nn.Module):
    def __init__(self, spec: LlamaSpec, rotary: Rotary) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(spec.d_model, eps=spec.norm_eps)
        self.attn = Attention(spec, rotary)
        self.mlp_norm = nn.RMSNorm(spec.d_model, eps=spec.norm_eps)
        self.mlp = SwiGLU(spec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))  # (B, T, d)
        return x + self.mlp(self.mlp_norm(x))  # (B, T, d)


class Llama(nn.Module):
    """Token embedding, n pre-norm blocks, a final RMSNorm and the head (tied to the embedding
    where the spec says so). Blocks are keyed by layer index, so a pipeline stage is this same
    module with other stages' parts removed (trainer.pipeline.build_stage)."""

    def __init__(self, spec: LlamaSpec) -> None:
        super().__init__()
        self.spec = spec
        rotary = Rotary(spec)
        self.tok_emb = nn.Embedding(spec.vocab_size, spec.d_model)
        self.drop = nn.Dropout(spec.dropout)
        self.blocks = nn.ModuleDict({str(i): Block(spec, rotary) for i in range(spec.n_layers)})
        self.norm = nn.RMSNorm(spec.d_model, eps=spec.norm_eps)
        self.lm_head = nn.Linear(spec.d_model, spec.vocab_size, bias=False)
        if spec.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok_emb is not None:  # x: (B, T) token ids
            x = self.drop(self.tok_emb(x))  # (B, T, d)
        for block in self.blocks.values():
            x = block(x)  # (B, T, d), or (B, T/tp, d) under sequence parallelism
        if self.lm_head is not None:
            x = self.lm_head(self.norm(x))  # (B, T, vocab)
        return x


def initial_value(spec: LlamaSpec, name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """A fresh parameter, whole, on the CPU: N(0, 0.02) (transformers' initializer_range),
    output projections scaled by 1/sqrt(2 n_layers) as GPT-2 does, biases 0, norms 1; drawn
    per name (models.layers.seeded_normal), so every plan starts from the same weights."""
    if name.endswith("bias"):
        return torch.zeros(shape)
    if "norm" in name:
        return torch.ones(shape)
    std = 0.02 / math.sqrt(2 * spec.n_layers) if name.endswith(("out_proj.weight", "down_proj.weight")) else 0.02
    return seeded_normal(name, shape, std, seed)
