"""prepare-data: text files in, token shards and a dataset manifest out (corpus.dataset).

    inputs (URL or glob) -> groups of files -> one shard per group (tokenize, checksum, write)
                         -> dataset.json (the shards in input order)

A shard is named by what made it (the tokenizer's fingerprint, dtype, input format, and each
input's sha256), and its record is written after its objects: preparing again skips every
shard already there, so an interrupted run resumes and a rerun on the same inputs writes
nothing but the manifest. `flows/prepare_data.py` runs the same steps as Prefect tasks, one
per group, retried.

Tokenizing uses every core through `tokenizers`' batch encoding (RAYON_NUM_THREADS caps it).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import crc32c
import fsspec
import numpy as np
from parashift.corpus.dataset import (
    CHUNK_BYTES,
    DTYPES,
    MANIFEST_KEY,
    DatasetError,
    DatasetManifest,
    InputRecord,
    ShardRecord,
    TokenizerRecord,
    chunk_checksums,
    dtype_for,
    encode_dataset_manifest,
)
from parashift.corpus.documents import documents, expand_inputs, format_of, read_input
from parashift.corpus.tokenizer import Tokenizer
from parashift.storage import ObjectStore

# Input bytes per shard: big enough that a 2 GB corpus is a few dozen objects, small enough
# that a group's tokens fit a worker's memory while it is prepared.
GROUP_BYTES = 256 * 2**20
# Documents per call into the tokenizer: enough to keep every thread busy.
ENCODE_BATCH = 2048


@dataclass(frozen=True)
class PrepareOptions:
    """What besides the inputs decides a shard's content."""

    text_format: str = "auto"
    text_field: str = "text"


def input_groups(urls: list[str], sizes: list[int], group_bytes: int = GROUP_BYTES) -> list[list[str]]:
    """Consecutive runs of input files of about `group_bytes` each (a larger file alone)."""
    groups: list[list[str]] = []
    current: list[str] = []
    held = 0
    for url, size in zip(urls, sizes, strict=True):
        if current and held + size > group_bytes:
            groups.append(current)
            current, held = [], 0
        current.append(url)
        held += size
    return groups + ([current] if current else [])


def plan_groups(input_url: str, storage_options: dict[str, Any] | None = None,
                group_bytes: int = GROUP_BYTES) -> list[list[str]]:
    """The groups of the files `input_url` names (sizes from a listing; nothing read)."""
    urls = expand_inputs(input_url, storage_options)
    if not urls:
        raise DatasetError(f"{input_url} matches no files")
    fs = fsspec.core.url_to_fs(urls[0], **dict(storage_options or {}))[0]
    sizes = [int(fs.size(u)) for u in urls]
    return input_groups(urls, sizes, group_bytes)


def shard_id(tokenizer: Tokenizer, dtype: str, options: PrepareOptions, inputs: list[InputRecord]) -> str:
    what = [tokenizer.fingerprint, dtype, options.text_format, options.text_field, [i.sha256 for i in inputs]]
    return hashlib.sha256(json.dumps(what).encode()).hexdigest()[:24]


def _existing(store: ObjectStore, shard: str, dtype: np.dtype) -> ShardRecord | None:
    key = f"shards/{shard}.json"
    if not store.exists(key):
        return None
    try:
        record = ShardRecord.model_validate_json(store.get(key))
    except ValueError:
        return None
    if store.exists(record.tokens_key) and store.size(record.tokens_key) == record.tokens * dtype.itemsize:
        return record
    return None


def encode_documents(tokenizer: Tokenizer, texts: list[str], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, document ends) of `texts`, each followed by the end-of-document token where the
    tokenizer has one."""
    eos = tokenizer.eos_id
    pieces: list[np.ndarray] = []
    ends: list[int] = []
    total = 0
    for i in range(0, len(texts), ENCODE_BATCH):
        for ids in tokenizer.encode_batch(texts[i : i + ENCODE_BATCH]):
            piece = np.asarray(ids + [eos] if eos is not None else ids, dtype=dtype)
            pieces.append(piece)
            total += len(piece)
            ends.append(total)
    tokens = np.concatenate(pieces) if pieces else np.zeros(0, dtype)
    return tokens, np.asarray(ends, dtype="<u8")


def prepare_group(urls: list[str], out_url: str, tokenizer: Tokenizer, options: PrepareOptions = PrepareOptions(),
                  storage_options: dict[str, Any] | None = None,
                  out_options: dict[str, Any] | None = None) -> tuple[ShardRecord, bool]:
    """The shard of one group of input files: (its record, whether it was written now rather
    than found from an earlier run)."""
    dtype_name = dtype_for(tokenizer.vocab_size)
    dtype = DTYPES[dtype_name]
    read = [read_input(u, storage_options) for u in urls]
    inputs = [InputRecord(url=f.url, nbytes=f.nbytes, sha256=f.sha256) for f, _ in read]
    shard = shard_id(tokenizer, dtype_name, options, inputs)
    store = ObjectStore(out_url, dict(out_options or {}))
    found = _existing(store, shard, dtype)
    if found is not None:
        return found, False
    texts = [text for f, raw in read for text in documents(f.url, raw, format_of(f.url, options.text_format),
                                                              options.text_field)]
    del read
    tokens, ends = encode_documents(tokenizer, texts, dtype)
    body = tokens.astype(dtype, copy=False).tobytes()
    docs = ends.tobytes()
    record = ShardRecord(id=shard, inputs=inputs, tokens=len(tokens), documents=len(ends),
                         chunks=chunk_checksums(body, CHUNK_BYTES), docs_crc32c=crc32c.crc32c(docs))
    store.put(record.tokens_key, body)
    store.put(record.docs_key, docs)
    store.put(record.record_key, record.model_dump_json().encode())  # last: the shard's commit
    return record, True


def write_manifest(out_url: str, tokenizer: Tokenizer, shards: list[ShardRecord], options: PrepareOptions,
                   out_options: dict[str, Any] | None = None) -> DatasetManifest:
    """The dataset's manifest over `shards` (in input order), written last."""
    manifest = DatasetManifest(
        tokenizer=TokenizerRecord(name=tokenizer.name, fingerprint=tokenizer.fingerprint,
                                  vocab_size=tokenizer.vocab_size, eos_id=tokenizer.eos_id),
        dtype=dtype_for(tokenizer.vocab_size), text_format=options.text_format, text_field=options.text_field,
        shards=shards, tokens=sum(s.tokens for s in shards), documents=sum(s.documents for s in shards)).sealed()
    if manifest.tokens == 0:
        raise DatasetError("the inputs hold no text: an empty corpus is not a dataset")
    ObjectStore(out_url, dict(out_options or {})).put(MANIFEST_KEY, encode_dataset_manifest(manifest))
    return manifest


def prepare_dataset(input_url: str, out_url: str, tokenizer: Tokenizer, options: PrepareOptions = PrepareOptions(),
                    storage_options: dict[str, Any] | None = None, out_options: dict[str, Any] | None = None,
                    group_bytes: int = GROUP_BYTES,
                    on_shard: Callable[[ShardRecord, bool], None] = lambda record, written: None) -> DatasetManifest:
    """Every group in turn, then the manifest: what `parashift prepare-data` runs."""
    shards = []
    for urls in plan_groups(input_url, storage_options, group_bytes):
        record, written = prepare_group(urls, out_url, tokenizer, options, storage_options, out_options)
        on_shard(record, written)
        shards.append(record)
    return write_manifest(out_url, tokenizer, shards, options, out_options)
