"""Counts in words for the lines users read ("1 device", "3 devices"): one helper, so every log
line and message agrees."""

from __future__ import annotations

from collections.abc import Sequence


def counted(n: int, noun: str) -> str:
    """`n` and `noun`, plural unless `n` is 1 (nouns that take an `s`: device, worker, node)."""
    return f"{n:,} {noun}" if n == 1 else f"{n:,} {noun}s"


def counted_each(ns: Sequence[int], noun: str, sep: str = ", ") -> str:
    """Several counts of one noun ("2 -> 3 -> 1 devices"), singular only for a lone 1."""
    return counted(ns[0], noun) if len(ns) == 1 else f"{sep.join(f'{n:,}' for n in ns)} {noun}s"


def gib(n_bytes: float) -> str:
    """Bytes in GiB to three significant digits: a small device's 0.04 GiB read "0.0 GiB"."""
    return f"{n_bytes / 2**30:.3g} GiB"
