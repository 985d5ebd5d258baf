"""The checkpoint manifest: what a committed checkpoint holds and where each byte lives.

A manifest is compact JSON (pydantic v2, unknown fields rejected). Tensor payloads are raw
bytes in per-rank objects; the manifest records, per slice, the object, the byte range, the
order its dims were stored in, and a CRC-32C per chunk of whole outer rows (`ptc.chunks`), so a
reader can read and verify any run of chunks without the rest of the slice.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

FORMAT_VERSION = 2  # 1: one sha256 per slice and per object (whole-slice reads only)

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


class Manifest(_Strict):
    """A committed checkpoint. Written last, atomically: a checkpoint without one does not exist."""

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

    @model_validator(mode="after")
    def _consistent(self) -> Manifest:
        if self.format_version != FORMAT_VERSION:
            raise ValueError(f"format_version {self.format_version}: this parashift reads format {FORMAT_VERSION}")
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
