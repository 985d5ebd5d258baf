"""A prepared dataset in storage: token shards, a document index per shard, and a manifest
under checksum.

    {dataset}/dataset.json            the manifest (written last: a dataset exists once it does)
    {dataset}/shards/{id}.tokens      little-endian uint16 or uint32 token ids, documents joined
                                      by the tokenizer's end-of-document token
    {dataset}/shards/{id}.docs        little-endian uint64: where each document ends, in tokens
    {dataset}/shards/{id}.json        the shard's record (its commit: prepare skips a shard whose
                                      record and objects are there)

Integrity as in checkpoints: a CRC-32C per chunk of `CHUNK_BYTES` of every shard, and the
manifest's own sha256 (`digest`). Opening a dataset checks the manifest and every shard's size
(seconds, no data read); a reader verifies each chunk it reads, so a damaged byte is refused
the first time anything reads it, never trained on.

The tokens of a dataset are its shards' tokens one after another: one address space the
sampler (trainer.data) cuts into windows without reading anything.
"""

from __future__ import annotations

import bisect
import hashlib
from datetime import UTC, datetime
from typing import Any, Literal

import crc32c
import numpy as np
from parashift.storage import ObjectStore, StorageError
from pydantic import BaseModel, ConfigDict, Field, ValidationError

FORMAT_VERSION = 1
MANIFEST_KEY = "dataset.json"
# Integrity granularity: a sample of a few thousand tokens reads at most two extra chunks.
CHUNK_BYTES = 64 * 2**10
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


class DatasetError(ValueError):
    """A prepared dataset that cannot be used as it is; one line that says why and where."""


def dtype_for(vocab_size: int) -> Literal["uint16", "uint32"]:
    """The narrowest token dtype that holds every id of the vocabulary."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


def chunk_checksums(data: bytes | memoryview, chunk_bytes: int = CHUNK_BYTES) -> list[int]:
    view = memoryview(data)
    return [crc32c.crc32c(view[i : i + chunk_bytes]) for i in range(0, len(view), chunk_bytes)]


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class InputRecord(_Record):
    url: str
    nbytes: int
    sha256: str


class TokenizerRecord(_Record):
    name: str
    fingerprint: str
    vocab_size: int
    eos_id: int | None


class ShardRecord(_Record):
    """One shard: the inputs it was made from, its token and document counts, its checksums."""

    id: str
    inputs: list[InputRecord]
    tokens: int = Field(ge=0)
    documents: int = Field(ge=0)
    chunks: list[int] = Field(description="CRC-32C of each CHUNK_BYTES of the tokens object")
    docs_crc32c: int

    @property
    def tokens_key(self) -> str:
        return f"shards/{self.id}.tokens"

    @property
    def docs_key(self) -> str:
        return f"shards/{self.id}.docs"

    @property
    def record_key(self) -> str:
        return f"shards/{self.id}.json"


class DatasetManifest(_Record):
    format_version: Literal[1] = FORMAT_VERSION
    created_at: str = Field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))
    tokenizer: TokenizerRecord
    dtype: Literal["uint16", "uint32"]
    chunk_bytes: int = CHUNK_BYTES
    text_format: str
    text_field: str
    shards: list[ShardRecord]
    tokens: int
    documents: int
    digest: str = ""

    def body(self) -> bytes:
        """The canonical bytes the digest covers: everything but the digest."""
        return self.model_dump_json(exclude={"digest"}).encode()

    def sealed(self) -> DatasetManifest:
        return self.model_copy(update={"digest": "sha256:" + hashlib.sha256(self.body()).hexdigest()})


def encode_dataset_manifest(manifest: DatasetManifest) -> bytes:
    return manifest.sealed().model_dump_json(indent=1).encode()


def decode_dataset_manifest(raw: bytes, where: str) -> DatasetManifest:
    """The manifest, or DatasetError if it is not one of ours or its digest does not match."""
    try:
        manifest = DatasetManifest.model_validate_json(raw)
    except ValidationError as error:
        first = error.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        raise DatasetError(f"{where} is not a prepared dataset manifest ({loc}: {first['msg']})") from None
    if manifest.digest != manifest.sealed().digest:
        raise DatasetError(f"{where}: the manifest's digest does not match its content (changed after it was written)")
    return manifest


class PreparedTokens:
    """A prepared dataset's tokens as one address space, read by ranged reads and verified
    chunk by chunk. Holds the manifest and per-shard offsets only: memory does not grow with
    the corpus."""

    def __init__(self, store: ObjectStore, manifest: DatasetManifest) -> None:
        self.store = store
        self.manifest = manifest
        self.dtype = DTYPES[manifest.dtype]
        self.chunk_bytes = manifest.chunk_bytes
        self.starts = np.cumsum([0] + [s.tokens for s in manifest.shards]).tolist()  # token offset of each shard
        self.tokens_read = 0
        self.bytes_read = 0

    def __len__(self) -> int:
        return int(self.starts[-1])

    def _pieces(self, start: int, end: int) -> list[tuple[int, int, int]]:
        """(shard index, first token, end token) in shard coordinates covering [start, end)."""
        out = []
        shard = bisect.bisect_right(self.starts, start) - 1
        while start < end:
            base, top = self.starts[shard], self.starts[shard + 1]
            stop = min(end, top)
            if stop > start:
                out.append((shard, start - base, stop - base))
            start = max(start, stop)
            shard += 1
        return out

    def read_many(self, ranges: list[tuple[int, int]]) -> list[np.ndarray]:
        """Tokens [start, end) of each range, as int64, in one batch of ranged reads."""
        requests: list[tuple[str, int, int]] = []
        plan: list[list[tuple[int, int, int, int]]] = []  # per range: (request, shard, byte offset, tokens)
        for start, end in ranges:
            if not 0 <= start <= end <= len(self):
                raise DatasetError(f"tokens [{start}, {end}) outside the dataset's {len(self)}")
            parts = []
            for shard, first, stop in self._pieces(start, end):
                record = self.manifest.shards[shard]
                size = record.tokens * self.dtype.itemsize
                c0 = first * self.dtype.itemsize // self.chunk_bytes
                c1 = (stop * self.dtype.itemsize - 1) // self.chunk_bytes
                lo, hi = c0 * self.chunk_bytes, min((c1 + 1) * self.chunk_bytes, size)
                parts.append((len(requests), shard, first * self.dtype.itemsize - lo, stop - first))
                requests.append((record.tokens_key, lo, hi))
            plan.append(parts)
        try:
            blobs = self.store.get_ranges(requests)
        except (StorageError, FileNotFoundError, OSError) as error:
            raise DatasetError(f"{self.store.url}: a shard cannot be read ({type(error).__name__}: {error})") from None
        shards = [shard for parts in plan for _, shard, *_ in parts]
        for (key, lo, hi), blob, shard in zip(requests, blobs, shards, strict=True):
            self._verify(shard, key, lo, hi, blob)
        out = []
        for parts in plan:
            pieces = [np.frombuffer(blobs[req], dtype=self.dtype, count=n, offset=skip) for req, _, skip, n in parts]
            out.append(np.concatenate(pieces).astype(np.int64) if pieces else np.zeros(0, np.int64))
        self.tokens_read += sum(e - s for s, e in ranges)
        self.bytes_read += sum(len(b) for b in blobs)
        return out

    def document_ends(self) -> np.ndarray:
        """Where each document ends, in the dataset's token addresses (8 bytes per document:
        read from the shards' indexes, each verified by its CRC-32C)."""
        ends = []
        for base, record in zip(self.starts, self.manifest.shards, strict=False):
            raw = self.store.get(record.docs_key)
            if crc32c.crc32c(raw) != record.docs_crc32c or len(raw) != 8 * record.documents:
                raise DatasetError(f"{self.store.url_for(record.docs_key)}: fails its checksum: the document index "
                                   "is damaged; prepare the dataset again")
            ends.append(np.frombuffer(raw, dtype="<u8").astype(np.int64) + base)
        return np.concatenate(ends) if ends else np.zeros(0, np.int64)

    def _verify(self, shard: int, key: str, lo: int, hi: int, blob: bytes) -> None:
        if len(blob) != hi - lo:
            raise DatasetError(f"{self.store.url_for(key)}: shorter than its manifest says (truncated)")
        chunks = self.manifest.shards[shard].chunks
        first = lo // self.chunk_bytes
        for i, crc in enumerate(chunk_checksums(blob, self.chunk_bytes)):
            if crc != chunks[first + i]:
                raise DatasetError(f"{self.store.url_for(key)}: chunk {first + i} (bytes {lo + i * self.chunk_bytes}...) "
                                   "fails its checksum: the shard is damaged; prepare the dataset again")


def open_dataset(url: str, storage_options: dict[str, Any] | None = None) -> PreparedTokens:
    """The dataset at `url`, its manifest checked and every shard present at its size."""
    store = ObjectStore(url, dict(storage_options or {}))
    where = store.url_for(MANIFEST_KEY)
    try:
        raw = store.get(MANIFEST_KEY)
    except (StorageError, FileNotFoundError) as error:
        raise DatasetError(f"no prepared dataset at {url} ({where}: {type(error).__name__})") from None
    manifest = decode_dataset_manifest(raw, where)
    itemsize = DTYPES[manifest.dtype].itemsize
    if manifest.tokenizer.vocab_size > np.iinfo(DTYPES[manifest.dtype]).max + 1:
        raise DatasetError(f"{where}: dtype {manifest.dtype} cannot hold the tokenizer's {manifest.tokenizer.vocab_size} ids")
    for shard in manifest.shards:
        try:
            size = store.size(shard.tokens_key)
        except (StorageError, FileNotFoundError):
            raise DatasetError(f"{store.url_for(shard.tokens_key)}: missing (the manifest lists it)") from None
        if size != shard.tokens * itemsize:
            raise DatasetError(f"{store.url_for(shard.tokens_key)}: {size} bytes where the manifest says "
                               f"{shard.tokens * itemsize} (truncated or replaced)")
    if manifest.tokens == 0:
        raise DatasetError(f"{where}: the dataset holds no tokens (an empty corpus)")
    return PreparedTokens(store, manifest)
