"""Deterministic data: a byte-level corpus, a seeded global sample order per epoch, and a
position (samples consumed) that says exactly where training is in the data.

The global order does not depend on the number of devices: a step takes the next
`global_batch` samples of the stream and splits them among ranks, so a run on any device
count, or one that changes device count, sees every sample of an epoch exactly once.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

import fsspec
import numpy as np
import torch

from specs import DataSpec

BUILTIN_STDLIB = "builtin://python-stdlib"


def builtin_corpus_files() -> list[str]:
    """The default corpus: the Python standard library's own top-level modules, which every
    machine that runs parashift has. Sorted, so the corpus is the same on every rank."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [f"file://{p}" for p in sorted(stdlib.glob("*.py"))]


def _expand(url: str, storage_options: dict) -> list[str]:
    if url == BUILTIN_STDLIB:
        return builtin_corpus_files()
    files = fsspec.open_files(url, mode="rb", **storage_options)
    return sorted(f.full_name if "://" in f.full_name else f.path for f in files) if files else []


def load_tokens(spec: DataSpec) -> np.ndarray:
    """The whole corpus as a 1-D token array (uint16 covers the byte vocabulary and token files)."""
    storage_options = dict(spec.storage_options)
    paths = _expand(spec.url, storage_options)
    if not paths:
        raise FileNotFoundError(f"data.url {spec.url!r} matches no files")
    budget = spec.max_bytes or 1 << 62
    chunks: list[bytes] = []
    for path in paths:
        if budget <= 0:
            break
        with fsspec.open(path, "rb", **({} if path.startswith("file://") else storage_options)) as handle:
            data = handle.read(budget)
        chunks.append(data)
        budget -= len(data)
    raw = b"".join(chunks)
    if spec.format == "tokens":
        usable = len(raw) - len(raw) % 2
        return np.frombuffer(raw[:usable], dtype="<u2").astype(np.uint16)
    return np.frombuffer(raw, dtype=np.uint8).astype(np.uint16)  # byte-level tokenizer


@dataclass(frozen=True)
class DataPosition:
    """Where training is in the data: samples consumed since the start of training."""

    samples_consumed: int = 0

    @classmethod
    def from_manifest(cls, data_position: dict[str, int]) -> DataPosition:
        """The position a checkpoint's manifest records (`to_manifest`)."""
        return cls(int(data_position["samples_consumed"]))

    def to_manifest(self, samples_per_epoch: int) -> dict[str, int]:
        """The manifest's `data_position`: the count, and the epoch and sample in it for readers."""
        return {
            "samples_consumed": self.samples_consumed,
            "epoch": self.samples_consumed // samples_per_epoch,
            "sample_in_epoch": self.samples_consumed % samples_per_epoch,
        }


class SampleStream:
    """Samples are non-overlapping windows of seq_len + 1 tokens; epoch e visits them in the
    order of a permutation seeded by (seed, e)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int) -> None:
        self.tokens = torch.from_numpy(tokens.astype(np.int64))
        self.seq_len = seq_len
        self.seed = seed
        self.samples_per_epoch = (len(tokens) - 1) // seq_len
        if self.samples_per_epoch < 1:
            raise ValueError(f"corpus of {len(tokens)} tokens is shorter than one sample of {seq_len + 1}")
        self._epoch_orders: dict[int, torch.Tensor] = {}

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch not in self._epoch_orders:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epoch_orders = {epoch: torch.randperm(self.samples_per_epoch, generator=generator)}
        return self._epoch_orders[epoch]

    def sample_ids(self, start: int, count: int) -> list[tuple[int, int]]:
        """(epoch, window index) of global samples [start, start + count)."""
        out = []
        for k in range(start, start + count):
            epoch, i = divmod(k, self.samples_per_epoch)
            out.append((epoch, int(self._order(epoch)[i])))
        return out

    def batch(self, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets for global samples [start, start + count)."""
        windows = [self.tokens[i * self.seq_len : i * self.seq_len + self.seq_len + 1] for _, i in self.sample_ids(start, count)]
        stacked = torch.stack(windows)  # (count, T + 1)
        return stacked[:, :-1], stacked[:, 1:]  # (count, T), (count, T)


def rank_share(global_batch: int, world_size: int, rank: int) -> tuple[int, int]:
    """(offset, count) of this rank's contiguous share of a global batch. Shares differ by at
    most one sample, so batches that do not divide by the device count still train correctly."""
    base, extra = divmod(global_batch, world_size)
    count = base + (1 if rank < extra else 0)
    offset = rank * base + min(rank, extra)
    return offset, count


def micro_batches(count: int, micro_batch: int) -> list[tuple[int, int]]:
    """Split a rank's share into (offset, size) micro-batches of at most `micro_batch` samples."""
    return [(o, min(micro_batch, count - o)) for o in range(0, count, micro_batch)]
