"""The checkpoint manifest: what a committed checkpoint holds and where each byte lives.

A manifest is compact JSON (pydantic v2, unknown fields rejected). Tensor payloads are raw
bytes in per-rank objects; the manifest records, per slice, the object, the byte range, the
order its dims were stored in, and a CRC-32C per chunk of whole outer rows (`ptc.chunks`), so a
reader can read and verify any run of chunks without the rest of the slice.

The manifest is under a checksum of its own: `digest`, the sha256 of the compact JSON of every
other field (`encode_manifest`), checked on every read. `encode_manifest` writes one,
`decode_manifest` reads one, by a reader per format version (`READERS`): the one place that
knows which versions this parashift reads.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

# 1: one sha256 per slice and per object (whole-slice reads only)
# 2: a CRC-32C per chunk of whole outer rows
# 3: format 2 + `digest` (the manifest's own sha256) + `writer` (the lease it was committed under)
FORMAT_VERSION = 3
DIGEST_PREFIX = "sha256:"

# An object a manifest names is a plain file in the checkpoint's own folder: a key read from
# storage never reaches outside it ("../", absolute paths, sub-folders and odd names refused).
OBJECT_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")


def _utc_now_iso() -> str:
    return datetime.now(UTC).isoformat()


@dataclass(frozen=True)
class SliceKey:
    """Names one rectangular slice of a global tensor: per-dimension start offsets and lengths."""

    tensor: str
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "offsets", tuple(int(o) for o in self.offsets))
        object.__setattr__(self, "lengths", tuple(int(n) for n in self.lengths))
        if len(self.offsets) != len(self.lengths):
            raise ValueError(f"slice of {self.tensor!r}: offsets and lengths differ in rank")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SliceRecord(_Strict):
    """One rectangular slice of a global tensor, stored at [byte_offset, byte_offset+nbytes) of
    `object`, its dims in `dim_order` (row-major), checked per chunk: `chunks` = [[nbytes, crc32c], ...]."""

    tensor: str
    offsets: list[int]
    lengths: list[int]
    object: str  # object key relative to the checkpoint folder, e.g. "rank00001.bin"
    byte_offset: int = Field(ge=0)
    nbytes: int = Field(ge=0)
    dim_order: list[int]
    chunks: list[tuple[int, int]]
    # The same bytes in node-local tiers: [object, byte_offset] in each holding object (a rank's
    # whole state, kept on its node only) of a rank that held this slice.
    copies: list[tuple[str, int]] = Field(default_factory=list)

    @model_validator(mode="after")
    def _consistent(self) -> SliceRecord:
        if len(self.offsets) != len(self.lengths):
            raise ValueError(f"slice of {self.tensor!r}: offsets and lengths differ in rank")
        if sorted(self.dim_order) != list(range(len(self.lengths))):
            raise ValueError(f"slice of {self.tensor!r}: dim_order {self.dim_order} is not a permutation of its dims")
        if sum(n for n, _ in self.chunks) != self.nbytes or any(n <= 0 for n, _ in self.chunks):
            raise ValueError(f"slice of {self.tensor!r}: its chunks do not add up to its {self.nbytes} bytes")
        return self

    @property
    def key(self) -> SliceKey:
        return SliceKey(self.tensor, tuple(self.offsets), tuple(self.lengths))

    @property
    def byte_end(self) -> int:
        return self.byte_offset + self.nbytes


class TensorRecord(_Strict):
    """A global tensor: dtype (string, e.g. "float32"), global shape and where its slices are."""

    name: str
    dtype: str
    shape: list[int]
    slices: list[SliceRecord]


class ObjectRecord(_Strict):
    """One stored object of a checkpoint (key relative to the checkpoint folder). Its bytes are
    checked by its slices' chunks: one pass over each byte."""

    key: str
    nbytes: int = Field(ge=0)

    @model_validator(mode="after")
    def _plain_name(self) -> ObjectRecord:
        if not OBJECT_NAME.fullmatch(self.key) or self.key == "manifest.json":
            raise ValueError(f"object {self.key!r} is not a plain file name of the checkpoint's folder")
        return self


class WriterRecord(_Strict):
    """The job lease a manifest was committed under (`storage.lease`): its fencing token."""

    generation: int = Field(ge=1)
    run_id: str


class Manifest(_Strict):
    """A committed checkpoint. Written last, atomically: a checkpoint without one does not exist.

    `format_version` is what the manifest was read as; readers of older formats upgrade it in
    memory (`decode_manifest`), and a manifest is always written in the current one."""

    format_version: int = FORMAT_VERSION
    job_id: str
    step: int = Field(ge=0)
    created_at: str = Field(default_factory=_utc_now_iso)  # ISO 8601, UTC
    world_size: int = Field(ge=1)
    # The checkpoint this one's training continued from (None: it started fresh). Retention
    # follows these links, so a checkpoint the job did not continue from (refused, abandoned)
    # never counts as one of the kept ones.
    previous_step: int | None = Field(default=None, ge=0)
    data_position: dict[str, int]
    plan: dict[str, Any]
    tensors: dict[str, TensorRecord]
    objects: dict[str, ObjectRecord]
    metadata: dict[str, Any] = Field(default_factory=dict)
    # The job lease this checkpoint was committed under (None: an unfenced commit, or format 2).
    writer: WriterRecord | None = None

    @model_validator(mode="after")
    def _consistent(self) -> Manifest:
        if self.previous_step is not None and self.previous_step >= self.step:
            raise ValueError(f"previous_step {self.previous_step} is not before step {self.step}")
        for key, obj in self.objects.items():
            if obj.key != key:
                raise ValueError(f"objects[{key!r}] has key {obj.key!r}")
        for name, tensor in self.tensors.items():
            if tensor.name != name:
                raise ValueError(f"tensors[{name!r}] has name {tensor.name!r}")
            for s in tensor.slices:
                if s.tensor != name:
                    raise ValueError(f"a slice of tensors[{name!r}] names tensor {s.tensor!r}")
                obj = self.objects.get(s.object)
                if obj is None:
                    raise ValueError(f"slice of {name!r} points at unknown object {s.object!r}")
                if s.byte_end > obj.nbytes:
                    raise ValueError(
                        f"slice of {name!r} ends at byte {s.byte_end} past the end of "
                        f"{s.object!r} ({obj.nbytes} bytes)"
                    )
        return self

    def all_slices(self) -> list[SliceRecord]:
        """Every slice of every tensor, in tensor order."""
        return [s for t in self.tensors.values() for s in t.slices]


# ---------------------------------------------------------------------------------- bytes


class ManifestRefused(ValueError):
    """The bytes are not a manifest this parashift reads (one line: why)."""


# A manifest's digest is its last member, after the compact JSON of every other field.
_DIGEST_TAIL = re.compile(rb',"digest":"(sha256:[0-9a-f]{64})"\}\s*$')
_VERSION_HEAD = re.compile(rb'\s*\{\s*"format_version"\s*:\s*(-?\d+)\s*[,}]')


def manifest_digest(body: bytes) -> str:
    """sha256 of a manifest's JSON without its digest member."""
    return DIGEST_PREFIX + hashlib.sha256(body).hexdigest()


def encode_manifest(manifest: Manifest) -> bytes:
    """The manifest as written, in the current format: its compact JSON (pydantic's, fields in
    schema order: the canonical form), then `digest`, the sha256 of those bytes, as the last
    member. Any change to the bytes before it, by hand or by corruption, fails the check."""
    body = manifest.model_copy(update={"format_version": FORMAT_VERSION}).model_dump_json().encode()
    return body[:-1] + b',"digest":"' + manifest_digest(body).encode() + b'"}'


def _validate(raw: bytes) -> Manifest:
    return Manifest.model_validate_json(raw)


def _read_v3(raw: bytes) -> Manifest:
    found = _DIGEST_TAIL.search(raw, max(0, len(raw) - 200))
    if found is None:
        raise ManifestRefused("format 3 without its digest as its last member: edited by hand or written by something else")
    body = raw[: found.start()] + b"}"
    recorded, actual = found.group(1).decode(), manifest_digest(body)
    if recorded != actual:
        raise ManifestRefused(f"digest mismatch: recorded {recorded[:23]}..., its content gives {actual[:23]}... "
                              "(edited by hand or corrupted)")
    return _validate(body)


def _read_v2(raw: bytes) -> Manifest:
    """Format 2: no digest (nothing to check it against), no writer; upgraded in memory."""
    manifest = _validate(raw)
    if "writer" in manifest.model_fields_set:
        raise ManifestRefused("format 2 has no field 'writer'")
    return manifest.model_copy(update={"format_version": FORMAT_VERSION})


# One reader per format version this parashift reads; the only place versions are checked.
READERS: dict[int, Callable[[bytes], Manifest]] = {2: _read_v2, 3: _read_v3}


def format_version_of(raw: bytes) -> Any:
    """The `format_version` of manifest bytes: read from their head where a manifest writer
    puts it, else from the whole document. ManifestRefused when they are not a JSON object."""
    head = _VERSION_HEAD.match(raw, 0, 200)
    if head is not None:
        return int(head.group(1))
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ManifestRefused(f"not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ManifestRefused(f"not a JSON object but {type(doc).__name__}")
    return doc.get("format_version")


def decode_manifest(raw: bytes) -> Manifest:
    """Read manifest bytes by their format's reader. ManifestRefused when they are not JSON, of
    a format with no reader, or fail their digest; pydantic's ValidationError when they do
    not match the schema."""
    version = format_version_of(raw)
    reader = READERS.get(version) if isinstance(version, int) and not isinstance(version, bool) else None
    if reader is None:
        raise ManifestRefused(f"format {version!r}; this parashift reads formats {sorted(READERS)}"
                              " (written by another version: resume it with that version)")
    return reader(raw)
