"""Building blocks every family shares: the input-major linear that row parallelism splits on
dim 0, the loss as a token sum, and initial values drawn per parameter name."""

from __future__ import annotations

import zlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class InputMajorLinear(nn.Module):
    """A linear layer whose weight is held (in_features, out_features), as GPT-2's Conv1D.

    Why not `nn.Linear` (out, in): row parallelism splits a linear's input features. Held
    input-major, that split is dim 0, like every other split a plan makes (column-parallel
    outputs, vocabulary rows, FSDP's shards), so each rank's share of every tensor is a run of
    whole rows: contiguous in memory and in checkpoints, never transposed on a save or restore.
    (Hugging Face checkpoints hold these (out, in): the families' adapters transpose them.)
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(in_features, out_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out)
        y = x @ self.weight
        return y if self.bias is None else y + self.bias


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum of per-token cross-entropy, so callers can normalise by the global token count."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1), reduction="sum")


def box_index(box: Any) -> tuple[slice, ...]:
    """The index of a box (anything with `offsets` and `lengths`, e.g. a ptc Slice) into its tensor."""
    return tuple(slice(o, o + n) for o, n in zip(box.offsets, box.lengths, strict=True))


def seeded_normal(name: str, shape: tuple[int, ...], std: float, seed: int) -> torch.Tensor:
    """N(0, std) of `shape`, drawn from a generator seeded by the job's seed and the parameter's
    name. Why per name: a rank that holds part of a parameter under any plan fills its part from
    the same draw, one parameter at a time, so no rank ever builds the whole model, and every
    plan starts from the same weights."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.normal(0.0, std, shape, generator=generator)
