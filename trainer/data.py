"""Deterministic data: the job's tokens, a seeded global sample order per epoch, and a
position (samples consumed) that says exactly where training is in the data.

The tokens come from a `TokenSource`: a small corpus tokenized in memory at start (`text`,
`tokens`), or a prepared dataset streamed by ranged reads (`prepared`, corpus.dataset), whose
memory does not grow with the corpus. The order is computed from the token count alone
(a permutation of fixed windows), so no data is read to know what comes next.

The global order does not depend on the number of devices: a step takes the next
`global_batch` samples of the stream and splits them among ranks, so a run on any device
count, or one that changes device count, sees every sample of an epoch exactly once.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import sysconfig
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import fsspec
import numpy as np
import torch
from parashift.corpus import load_tokenizer, open_dataset
from parashift.specs import DataSpec, environ

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
    """The whole (small) corpus as a 1-D token array: raw uint16 token files, or text files
    tokenized here, each file a document followed by the tokenizer's end-of-document token."""
    return _tokens_of(_read_files(spec), spec)


def split_held_out(spec: DataSpec, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(training tokens, held-out tokens) for `data.eval_share`: whole documents (files) held
    out, chosen by a permutation seeded by `seed`, until they hold the share of the corpus's
    bytes (at least one, and never every one). The same split on every rank and every run."""
    assert spec.eval_share is not None
    files = _read_files(spec)
    if len(files) < 2:
        raise ValueError(f"data.eval_share needs at least 2 documents (files) in {spec.url!r}; found {len(files)}")
    order = torch.randperm(len(files), generator=torch.Generator().manual_seed(seed * 1_000_003 + 999_983)).tolist()
    total, held, chosen = sum(len(f) for f in files), 0, set()
    for index in order[:-1]:
        if held >= spec.eval_share * total and chosen:
            break
        chosen.add(index)
        held += len(files[index])
    train = [f for i, f in enumerate(files) if i not in chosen]
    held_out = [f for i, f in enumerate(files) if i in chosen]
    return _tokens_of(train, spec), _tokens_of(held_out, spec)


def _read_files(spec: DataSpec) -> list[bytes]:
    """Each file's bytes (in URL order), within `max_bytes` in all."""
    storage_options = dict(spec.storage_options)
    paths = _expand(spec.url, storage_options)
    if not paths:
        raise FileNotFoundError(f"data.url {spec.url!r} matches no files")
    budget = spec.max_bytes  # None: all of it (a read of "at most 2**62 bytes" allocates them first)
    chunks: list[bytes] = []
    for path in paths:
        if budget is not None and budget <= 0:
            break
        with fsspec.open(path, "rb", **({} if path.startswith("file://") else storage_options)) as handle:
            data = handle.read() if budget is None else handle.read(budget)
        chunks.append(data)
        budget = None if budget is None else budget - len(data)
    return chunks


def _tokens_of(chunks: list[bytes], spec: DataSpec) -> np.ndarray:
    if spec.format == "tokens":
        raw = b"".join(chunks)
        usable = len(raw) - len(raw) % 2
        return np.frombuffer(raw[:usable], dtype="<u2").astype(np.uint16)
    if spec.bytes_tokenizer:
        return np.frombuffer(b"".join(chunks), dtype=np.uint8).astype(np.uint16)
    tokenizer = load_tokenizer(spec.tokenizer, dict(spec.storage_options))
    texts = [chunk.decode("utf-8", errors="replace") for chunk in chunks]
    eos = [] if tokenizer.eos_id is None else [tokenizer.eos_id]
    ids = [np.asarray(doc + eos, dtype=np.int64) for doc in tokenizer.encode_batch(texts)]
    return np.concatenate(ids) if ids else np.zeros(0, np.int64)


class TokenSource(Protocol):
    """Tokens addressed from 0 to len - 1, read a batch of ranges at a time."""

    def __len__(self) -> int: ...

    def read_many(self, ranges: list[tuple[int, int]]) -> list[np.ndarray]: ...


class InMemoryTokens:
    """A small corpus held whole (what `load_tokens` returns)."""

    def __init__(self, tokens: np.ndarray) -> None:
        self.tokens = tokens.astype(np.int64)

    def __len__(self) -> int:
        return len(self.tokens)

    def read_many(self, ranges: list[tuple[int, int]]) -> list[np.ndarray]:
        return [self.tokens[start:end] for start, end in ranges]


def token_source(spec: DataSpec, seed: int = 0, held_out: bool = False) -> TokenSource:
    """The spec's tokens: a prepared dataset streamed from storage, or a small corpus in memory;
    with `data.eval_share`, the training part (or, `held_out`, the held-out part) of it. With
    `data.eval_url`, `held_out` reads that corpus."""
    if held_out and spec.eval_url is not None:
        return token_source(spec.held_out())  # type: ignore[arg-type]
    if spec.format == "prepared":
        return open_dataset(spec.url, dict(spec.storage_options))
    if spec.eval_share is not None:
        return InMemoryTokens(split_held_out(spec, seed)[1 if held_out else 0])
    if held_out:
        raise ValueError("no held-out data: set data.eval_url or data.eval_share")
    return InMemoryTokens(load_tokens(spec))


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


def windows_within(document_ends: np.ndarray, seq_len: int) -> np.ndarray:
    """Start of every window of seq_len + 1 tokens that fits inside one document (a stride of
    seq_len from each document's start), in document order: 8 bytes per window."""
    ends = document_ends.astype(np.int64)
    begins = np.concatenate([[0], ends[:-1]])
    counts = np.maximum((ends - begins - 1) // seq_len, 0)
    first_of_doc = np.cumsum(counts) - counts  # index of each document's first window
    index = np.arange(int(counts.sum()), dtype=np.int64)
    return np.repeat(begins, counts) + (index - np.repeat(first_of_doc, counts)) * seq_len


class SampleStream:
    """Samples are windows of seq_len + 1 tokens starting every seq_len tokens (or, with
    `document_ends`, every such window inside one document); epoch e visits them in the order
    of a permutation seeded by (seed, e)."""

    def __init__(self, source: TokenSource | np.ndarray, seq_len: int, seed: int,
                 document_ends: np.ndarray | None = None) -> None:
        self.source = InMemoryTokens(source) if isinstance(source, np.ndarray) else source
        self.seq_len = seq_len
        self.seed = seed
        # Packed (None): window i starts at i * seq_len, across documents. Within documents:
        # the windows of each document in turn, none crossing its end (its tail is not trained).
        self.starts = None if document_ends is None else windows_within(document_ends, seq_len)
        self.samples_per_epoch = (len(self.source) - 1) // seq_len if self.starts is None else len(self.starts)
        if self.samples_per_epoch < 1:
            raise ValueError(f"corpus of {len(self.source)} tokens is shorter than one sample of {seq_len + 1}"
                             + ("" if self.starts is None else " within any one document"))
        self._epoch_orders: dict[int, torch.Tensor] = {}

    def _order(self, epoch: int) -> torch.Tensor:
        # The prefetcher's thread and the loop's sample log both ask, near an epoch's end for two
        # epochs: the one permutation cached is replaced, never read back after (a KeyError in CI).
        order = self._epoch_orders.get(epoch)
        if order is None:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            order = torch.randperm(self.samples_per_epoch, generator=generator)
            self._epoch_orders = {epoch: order}
        return order

    def sample_ids(self, start: int, count: int) -> list[tuple[int, int]]:
        """(epoch, window index) of global samples [start, start + count)."""
        out = []
        for k in range(start, start + count):
            epoch, i = divmod(k, self.samples_per_epoch)
            out.append((epoch, int(self._order(epoch)[i])))
        return out

    def windows(self, ids: Sequence[tuple[int, int]]) -> torch.Tensor:
        """The (len(ids), T + 1) tokens of those windows, in one batch of reads."""
        t = self.seq_len
        starts = [i * t if self.starts is None else int(self.starts[i]) for _, i in ids]
        rows = self.source.read_many([(start, start + t + 1) for start in starts])
        return torch.from_numpy(np.stack(rows)) if rows else torch.zeros((0, t + 1), dtype=torch.int64)

    def batch(self, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets for global samples [start, start + count)."""
        stacked = self.windows(self.sample_ids(start, count))  # (count, T + 1)
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


class Prefetcher:
    """Reads the next steps' batches on a background thread while this step trains.

    Which samples a rank reads at a step follows from the position alone (its share's
    requests, offset by the samples consumed), so the thread runs `depth` steps ahead without
    being told. `wait_s` is how long the training loop waited for data (torchtitan's data
    loading time); `read_s` how long the reads took, so tokens_read / read_s is the reader's rate.
    """

    def __init__(self, stream: SampleStream, share_offset: int, requests: list[tuple[int, int]],
                 global_batch: int, depth: int = 2) -> None:
        self.stream = stream
        self.share_offset = share_offset
        self.requests = requests  # (offset in the share, count) read each step
        self.global_batch = global_batch
        self.depth = depth
        self.wait_s = 0.0
        self.read_s = 0.0
        self.tokens_read = 0
        self._queue: queue.Queue[tuple[int, list[tuple[torch.Tensor, torch.Tensor]] | BaseException]] = queue.Queue(depth)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _read(self, position: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        started = time.perf_counter()
        first = position + self.share_offset
        out = [self.stream.batch(first + offset, count) for offset, count in self.requests]
        self.read_s += time.perf_counter() - started
        self.tokens_read += sum(count for _, count in self.requests) * (self.stream.seq_len + 1)
        return out

    def _run(self, position: int) -> None:
        while not self._stop.is_set():
            try:
                item: list[tuple[torch.Tensor, torch.Tensor]] | BaseException = self._read(position)
            except BaseException as error:  # noqa: BLE001 - handed to the training loop, which raises it
                item = error
            while not self._stop.is_set():
                try:
                    self._queue.put((position, item), timeout=0.1)
                    break
                except queue.Full:
                    continue
            if isinstance(item, BaseException):
                return
            position += self.global_batch

    def start(self, position: int) -> None:
        self._thread = threading.Thread(target=self._run, args=(position,), name="parashift-prefetch", daemon=True)
        self._thread.start()

    @property
    def tokens_per_s(self) -> float | None:
        """The reader's rate so far: tokens read per second spent reading."""
        return self.tokens_read / self.read_s if self.read_s > 0 else None

    def step(self, position: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The (inputs, targets) of each request of the step that starts at `position`."""
        started = time.perf_counter()
        at, item = self._queue.get()
        self.wait_s += time.perf_counter() - started
        if isinstance(item, BaseException):
            raise item
        if at != position:  # the loop moved otherwise than one step at a time: read in line
            raise RuntimeError(f"prefetched samples from {at}, the step starts at {position}")
        return item

    def close(self) -> None:
        """Stop the thread. What it read ahead is dropped at once: a put blocked on a full queue
        would otherwise hold the join for its timeout, paid by every planned change."""
        self._stop.set()
        with contextlib.suppress(queue.Empty):
            while True:
                self._queue.get_nowait()
        if self._thread is not None:
            self._thread.join(timeout=5)


class SampleLog:
    """The samples this rank trains, step by step, appended to `{folder}/rank{rank}-{pid}.jsonl`:
    set PARASHIFT_SAMPLE_LOG to a folder to audit that every sample of an epoch is trained
    exactly once across device changes and failures (the steps a failure undoes appear twice:
    the segment that committed them is the one that counts)."""

    ENV = environ.SAMPLE_LOG

    def __init__(self, folder: str, rank: int, job_id: str = "") -> None:
        Path(folder).mkdir(parents=True, exist_ok=True)
        self._file = open(Path(folder) / f"rank{rank}-{os.getpid()}.jsonl", "a", buffering=1)  # noqa: SIM115 - lives with the run
        self.rank, self.job_id = rank, job_id

    @classmethod
    def from_env(cls, rank: int, job_id: str = "") -> SampleLog | None:
        folder = os.environ.get(cls.ENV)
        return cls(folder, rank, job_id) if folder else None

    def write(self, step: int, dp_rank: int, ids: list[tuple[int, int]], world_size: int, start_step: int) -> None:
        """`world_size` and `start_step` name the segment (a job's run on one device count)."""
        record = {"job": self.job_id, "step": step, "rank": self.rank, "dp_rank": dp_rank, "world_size": world_size,
                  "start_step": start_step, "ids": ids}  # jobs sharing a machine may share the folder
        self._file.write(json.dumps(record) + "\n")
