"""Input documents for `prepare-data`: which files a URL or glob names, and the documents in each.

- text (`.txt`, `.md`, `.py`, anything else): one file is one document;
- JSONL (`.jsonl`, `.json`): one document per line, its `text_field`;
- Parquet (`.parquet`): one document per row of its `text_field` column (needs `pyarrow`).
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import fsspec

FORMATS = ("auto", "text", "jsonl", "parquet")


class InputError(ValueError):
    """An input file that cannot be read as documents; one line naming it."""


@dataclass(frozen=True)
class InputFile:
    """One input file: where, how big, and the sha256 of its bytes (what makes a prepared
    shard reusable: same inputs, same tokenizer, same shard)."""

    url: str
    nbytes: int
    sha256: str


def expand_inputs(url: str, storage_options: dict[str, Any] | None = None) -> list[str]:
    """Sorted URLs of the files `url` names (a file, a folder's files, or a glob)."""
    options = dict(storage_options or {})
    fs, _, paths = fsspec.get_fs_token_paths(url, storage_options=options)
    if len(paths) == 1 and fs.isdir(paths[0]):
        paths = [p for p in fs.find(paths[0]) if not fs.isdir(p)]
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    local = protocol in ("file", "local")
    return sorted(p if "://" in p else f"file://{p}" if local else f"{protocol}://{p.lstrip('/')}" for p in paths)


def read_input(url: str, storage_options: dict[str, Any] | None = None) -> tuple[InputFile, bytes]:
    with fsspec.open(url, "rb", **dict(storage_options or {})) as handle:
        raw = handle.read()
    return InputFile(url, len(raw), hashlib.sha256(raw).hexdigest()), raw


def format_of(url: str, declared: str = "auto") -> str:
    if declared != "auto":
        return declared
    name = url.lower()
    if name.endswith((".jsonl", ".json")):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    return "text"


def documents(url: str, raw: bytes, fmt: str, text_field: str = "text") -> Iterator[str]:
    """The documents of one input file's bytes, in file order."""
    if fmt == "text":
        try:
            yield raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise InputError(f"{url}: not UTF-8 text (byte {error.start})") from None
        return
    if fmt == "jsonl":
        for number, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise InputError(f"{url}:{number}: not JSON ({error.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
                raise InputError(f"{url}:{number}: no string field {text_field!r}")
            yield record[text_field]
        return
    if fmt == "parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise InputError(f"{url}: reading Parquet needs pyarrow (pip install pyarrow)") from None
        import pyarrow as pa

        try:
            parquet = pq.ParquetFile(io.BytesIO(raw))
        except pa.ArrowException as error:
            raise InputError(f"{url}: not a Parquet file ({error})") from None
        columns = parquet.schema_arrow.names
        if text_field not in columns:  # pyarrow says "No match for FieldRef.Name(text)" in a traceback
            raise InputError(f"{url}: no column {text_field!r} (columns: {', '.join(columns)}); name the text's "
                             "column with --text-field") from None
        table = parquet.read(columns=[text_field])
        for value in table.column(text_field).to_pylist():
            if value is not None:
                yield str(value)
        return
    raise InputError(f"{url}: unknown format {fmt!r} (one of {', '.join(FORMATS)})")
