"""Counts in words for the lines users read ("1 device", "3 devices"): one helper, so every log
line and message agrees."""

from __future__ import annotations


def counted(n: int, noun: str) -> str:
    """`n` and `noun`, plural unless `n` is 1 (nouns that take an `s`: device, worker, node)."""
    return f"{n:,} {noun}" if n == 1 else f"{n:,} {noun}s"
