"""How a stored box is laid out in bytes: dim order and checksum chunks.

A box is stored with its tensor's split dim outermost (`storage_order`), so the part of it
that any tensor-parallel degree's box covers is one contiguous byte range: a run of whole outer
rows. Integrity is checked per chunk of whole outer rows, and chunk edges sit at every split
point of degrees 1..MAX_ALIGNED_DEGREE along that dim, so a reader of such a box reads exactly
its bytes and verifies every one of them, with no chunk-edge overhead. Boxes of other degrees
read at most one chunk's worth of extra rows at each edge.
"""

from __future__ import annotations

from functools import cache
from math import prod

from parashift.ptc.layout import Slice, shard_extent

# Split points of every degree up to 8 (the devices of one node on the common GPU servers) are
# chunk edges. A dim of n elements has at most 1+2+...+7 = 28 of them inside, so this adds few
# chunks.
MAX_ALIGNED_DEGREE = 8
# The largest chunk: integrity granularity for whole-tensor reads. 4 MiB keeps the checksum
# list small (one entry per 4 MiB in the manifest) and each chunk's bytes hot in cache between
# checksumming and writing.
CHUNK_BYTES = 4 * 2**20


def storage_order(ndim: int, split_dim: int | None) -> tuple[int, ...]:
    """Dims in stored (row-major) order: the split dim first, the rest in natural order."""
    if split_dim is None or split_dim == 0 or ndim == 0:
        return tuple(range(ndim))
    return (split_dim, *(d for d in range(ndim) if d != split_dim))


def stored_lengths(box: Slice, order: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(box.lengths[d] for d in order)


def row_bytes(box: Slice, order: tuple[int, ...], itemsize: int) -> int:
    """Bytes of one outer row (one index of the outermost stored dim); a 0-d tensor is one row."""
    return prod(stored_lengths(box, order)[1:]) * itemsize


@cache  # a state has few distinct dim sizes, and a save or a held step's record asks for each per box
def split_points(size: int, max_degree: int = MAX_ALIGNED_DEGREE) -> frozenset[int]:
    """Every offset at which torch's Shard rule starts a box along a dim of `size` elements."""
    return frozenset(shard_extent(size, parts, index)[1]
                     for parts in range(2, max_degree + 1) for index in range(1, parts))


def chunk_rows(shape: tuple[int, ...], box: Slice, order: tuple[int, ...], itemsize: int, split_dim: int | None) -> list[int]:
    """Outer rows per checksum chunk of a stored box, in order (they sum to its outer length)."""
    if not order:
        return [1]
    outer = order[0]
    start, length = box.offsets[outer], box.lengths[outer]
    edges = {start, start + length}
    if split_dim == outer:
        edges |= {p for p in split_points(shape[outer]) if start < p < start + length}
    max_rows = max(1, CHUNK_BYTES // max(1, row_bytes(box, order, itemsize)))
    rows: list[int] = []
    ordered = sorted(edges)
    for lo, hi in zip(ordered, ordered[1:], strict=False):
        while hi - lo > max_rows:
            rows.append(max_rows)
            lo += max_rows
        rows.append(hi - lo)
    return [r for r in rows if r > 0]
