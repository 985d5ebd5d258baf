"""Assembling any box of a global tensor from the stored boxes that overlap it."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ptc.layout import Slice


def intersect(a: Slice, b: Slice) -> Slice | None:
    """The box both a and b cover, or None."""
    offsets, lengths = [], []
    for a_off, a_len, b_off, b_len in zip(a.offsets, a.lengths, b.offsets, b.lengths, strict=True):
        lo, hi = max(a_off, b_off), min(a_off + a_len, b_off + b_len)
        if hi <= lo:
            return None
        offsets.append(lo)
        lengths.append(hi - lo)
    return Slice(tuple(offsets), tuple(lengths))


def _local(box: Slice, within: Slice) -> tuple[slice, ...]:
    return tuple(slice(o - w, o - w + n) for o, w, n in zip(box.offsets, within.offsets, box.lengths, strict=True))


def assemble_region(
    wanted: Slice,
    stored: Sequence[Slice],
    load: Callable[[list[int]], list[torch.Tensor]],
    dtype: torch.dtype,
) -> torch.Tensor:
    """Build the `wanted` box from stored boxes. `load(indices)` returns those stored boxes as
    tensors (one batched read). Every element of `wanted` must be covered, or this raises."""
    overlaps = [(i, cut) for i, box in enumerate(stored) if (cut := intersect(wanted, box)) is not None]
    covered = sum(cut.numel for _, cut in overlaps)
    # Stored boxes of one tensor are disjoint by construction, so coverage is a sum.
    if covered != wanted.numel:
        raise ValueError(f"stored slices cover {covered} of the {wanted.numel} elements wanted")
    if len(overlaps) == 1 and stored[overlaps[0][0]] == wanted:
        return load([overlaps[0][0]])[0]
    out = torch.empty(wanted.lengths, dtype=dtype)
    pieces = load([i for i, _ in overlaps])
    for (i, cut), piece in zip(overlaps, pieces, strict=True):
        out[_local(cut, wanted)] = piece[_local(cut, stored[i])]
    return out
