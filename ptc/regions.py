"""Boxes of a global tensor: where two of them overlap."""

from __future__ import annotations

from parashift.ptc.layout import Slice


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
