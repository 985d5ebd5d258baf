"""ReconfigPlan: what every rank of a new Layout reads from a committed checkpoint, computed
before anything moves (after Tenplex's reconfiguration plans).

For each rank: the box of every tensor it holds under the new Layout, the stored boxes that
overlap it, and the byte ranges of those stored boxes that cover the overlap, widened to whole
checksum chunks so that every byte read is verified. Ranges that touch in one object become one
request. The restore executes exactly this plan; its totals (bytes needed, bytes read,
requests, bytes from the node-local tier) are what a user sees before a job is resharded.

Where a request is served from: object storage (REMOTE), the reader's node-local tier (LOCAL),
or the memory of a live worker that holds the same box from the segment before (LIVE, sent
over the process group: `with_live_copies`). Every source serves a stored box's exact bytes in
its stored dim order, so one plan and one set of chunk checksums serve all three.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field
from itertools import accumulate

import torch
from parashift.ptc.chunks import row_bytes, stored_lengths
from parashift.ptc.codec import tensor_bytes, torch_dtype
from parashift.ptc.layout import Layout, Slice
from parashift.ptc.regions import intersect
from parashift.ptc.transpose import copy_across_transpose

LOCAL, REMOTE, LIVE = "local", "remote", "live"
LIVE_PREFIX = "live:"


def live_object(rank: int, index: int) -> str:
    """The name a plan gives box `index` of what live rank `rank` holds (never a stored key:
    stored object names have no colon)."""
    return f"{LIVE_PREFIX}{rank}:{index}"


def live_holder(obj: str) -> tuple[int, int]:
    """(rank, index) of a `live_object` name."""
    rank, index = obj[len(LIVE_PREFIX):].split(":")
    return int(rank), int(index)


@dataclass(frozen=True)
class StoredBox:
    """One box as a checkpoint stored it: in `object` from `byte_offset`, dims in `order`,
    checked per chunk of whole outer rows: `chunks` = ((nbytes, checksum), ...)."""

    tensor: str
    box: Slice
    order: tuple[int, ...]
    object: str
    byte_offset: int
    chunks: tuple[tuple[int, int], ...]
    copies: tuple[tuple[str, int], ...] = ()  # the same bytes at (object, byte_offset) in node-local tiers

    @property
    def nbytes(self) -> int:
        return sum(n for n, _ in self.chunks)

    def located(self, local_objects: frozenset[str]) -> tuple[str, int]:
        """Where a reader on a node holding `local_objects` reads this box: a copy on its node
        if there is one, else the stored object."""
        for obj, offset in self.copies:
            if obj in local_objects:
                return obj, offset
        return self.object, self.byte_offset


@dataclass(frozen=True)
class Piece:
    """Part of a destination box that one request carries: rows [row_start, row_end) of the
    stored box (outermost stored dim), found at `offset` in the request's bytes."""

    tensor: str
    dtype: str
    source: StoredBox
    row_start: int
    row_end: int
    offset: int
    cut: Slice  # the elements wanted, in global coordinates


@dataclass
class Request:
    """One ranged read: bytes [start, end) of `object`, with the chunks that verify them."""

    object: str
    start: int
    end: int
    source: str = REMOTE  # LOCAL: served from this node's tier
    pieces: list[Piece] = field(default_factory=list)
    checks: list[tuple[int, int, int]] = field(default_factory=list)  # (offset, nbytes, checksum)

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass
class RankReads:
    rank: int
    wanted: dict[str, Slice]
    dtypes: dict[str, str]
    requests: list[Request]

    @property
    def bytes_needed(self) -> int:
        return sum(box.numel * torch_dtype(self.dtypes[n]).itemsize for n, box in self.wanted.items())

    @property
    def bytes_read(self) -> int:
        return sum(r.nbytes for r in self.requests)

    def bytes_from(self, source: str) -> int:
        return sum(r.nbytes for r in self.requests if r.source == source)


@dataclass
class ReconfigPlan:
    step: int
    ranks: list[RankReads]

    def totals(self) -> dict[str, int]:
        return {
            "ranks": len(self.ranks),
            "bytes_needed": sum(r.bytes_needed for r in self.ranks),
            "bytes_read": sum(r.bytes_read for r in self.ranks),
            "requests": sum(len(r.requests) for r in self.ranks),
            "bytes_local": sum(r.bytes_from(LOCAL) for r in self.ranks),
            "bytes_remote": sum(r.bytes_from(REMOTE) for r in self.ranks),
            "bytes_live": sum(r.bytes_from(LIVE) for r in self.ranks),
        }

    def summary(self) -> list[dict[str, int]]:
        """Per new rank: bytes needed and read, requests, bytes from the node-local tier."""
        return [
            {"rank": r.rank, "bytes_needed": r.bytes_needed, "bytes_read": r.bytes_read, "requests": len(r.requests),
             "bytes_local": r.bytes_from(LOCAL)}
            for r in self.ranks
        ]


def _cover(stored: StoredBox, cut: Slice, itemsize: int) -> tuple[int, int, list[tuple[int, int, int]]]:
    """Rows [first, last) of the stored box covering `cut`, widened to whole chunks, and the
    chunks inside them as (row offset from `first` in bytes, nbytes, checksum)."""
    order = stored.order
    if not order:
        first_row, last_row = 0, 1
    else:
        outer = order[0]
        first_row = cut.offsets[outer] - stored.box.offsets[outer]
        last_row = first_row + cut.lengths[outer]
    per_row = row_bytes(stored.box, order, itemsize)
    # Chunk edges in rows from the box's start (strictly increasing: every chunk is whole rows,
    # at least one), so the chunks inside [lo, hi) are those from edge `first` to edge `last`.
    edges = [0, *accumulate(n // per_row for n, _ in stored.chunks)]
    first = bisect_right(edges, first_row) - 1
    last = bisect_left(edges, last_row)
    lo, hi = edges[first], edges[last]
    inside = zip(edges[first:last], stored.chunks[first:last], strict=True)
    checks = [((edge - lo) * per_row, n, crc) for edge, (n, crc) in inside]
    return lo, hi, checks


def _source(obj: str, local_objects: frozenset[str]) -> str:
    if obj.startswith(LIVE_PREFIX):
        return LIVE
    return LOCAL if obj in local_objects else REMOTE


def rank_reads(stored: dict[str, list[StoredBox]], dtypes: dict[str, str], wanted: dict[str, Slice], rank: int,
               local_objects: frozenset[str] = frozenset()) -> RankReads:
    """The requests one rank issues to assemble `wanted` (tensor -> its box) from `stored`.
    A box is read from its first copy in `local_objects` (live copies included), else from the
    stored object."""
    ranges: list[tuple[str, int, int, Piece | None, list[tuple[int, int, int]]]] = []
    for name, box in sorted(wanted.items()):
        itemsize = torch_dtype(dtypes[name]).itemsize
        covered = 0
        for source in stored.get(name, []):
            cut = intersect(box, source.box)
            if cut is None:
                continue
            covered += cut.numel
            lo, hi, checks = _cover(source, cut, itemsize)
            per_row = row_bytes(source.box, source.order, itemsize)
            obj, base = source.located(local_objects)
            piece = Piece(name, dtypes[name], source, lo, hi, 0, cut)
            ranges.append((obj, base + lo * per_row, base + hi * per_row, piece, checks))
        if covered != box.numel:
            raise ValueError(f"{name}: the checkpoint's boxes cover {covered} of the {box.numel} elements rank {rank} needs")
    # Coalesce: ranges that touch (or overlap) in one object become one request.
    requests: list[Request] = []
    known: set[int] | None = None  # chunk offsets the last request checks, kept once a range overlapped it
    for obj, start, end, piece, checks in sorted(ranges, key=lambda r: (r[0], r[1])):
        last = requests[-1] if requests else None
        # Overlapping the request's bytes so far, a range may share chunks it already checks;
        # touching them, or starting a request, it shares none.
        overlaps = last is not None and last.object == obj and start < last.end
        if last is None or last.object != obj or start > last.end:
            last = Request(obj, start, end, _source(obj, local_objects))
            requests.append(last)
            known = None
        base = start - last.start
        last.end = max(last.end, end)
        if piece is not None:
            last.pieces.append(Piece(piece.tensor, piece.dtype, piece.source, piece.row_start, piece.row_end, base, piece.cut))
        if overlaps and known is None:
            known = {off for off, _, _ in last.checks}
        if known is None:
            last.checks.extend([(base + off, n, c) for off, n, c in checks])
            continue
        for off, n, c in checks:
            if base + off not in known:
                known.add(base + off)
                last.checks.append((base + off, n, c))
    return RankReads(rank, dict(wanted), {n: dtypes[n] for n in wanted}, requests)


def reconfig_plan(step: int, stored: dict[str, list[StoredBox]], dtypes: dict[str, str], layout: Layout,
                  local_objects: dict[int, frozenset[str]] | None = None) -> ReconfigPlan:
    """Every rank's reads of a committed checkpoint under a new `layout`. Tensors the checkpoint
    does not hold (another rank count's RNG states) are not wanted."""
    local_objects = local_objects or {}
    ranks = []
    for rank in range(layout.world_size):
        wanted = {n: b for n, b in layout.boxes_of(rank).items() if n in stored}
        ranks.append(rank_reads(stored, dtypes, wanted, rank, local_objects.get(rank, frozenset())))
    return ReconfigPlan(step, ranks)


def with_live_copies(stored: dict[str, list[StoredBox]], holdings: dict[int, list[tuple[str, Slice, tuple[int, ...]]]],
                     reader: int) -> tuple[dict[str, list[StoredBox]], frozenset[str]]:
    """`stored` with a copy in every live rank's memory that holds a stored box exactly (same
    tensor, box and dim order: the same bytes, under the same checksums), and the names of
    those copies. `holdings`: live rank -> the boxes it holds, in its own order. The reader's
    own memory comes first; where other ranks hold a box too (data-parallel replicas), the
    first of them turns from box to box and from reader to reader, so that the bytes a
    reader takes over the network come from all of its holders."""
    held: dict[tuple[str, Slice, tuple[int, ...]], list[str]] = {}
    for rank in sorted(holdings):
        for index, key in enumerate(holdings[rank]):
            held.setdefault(key, []).append(live_object(rank, index))
    out: dict[str, list[StoredBox]] = {}
    objects: set[str] = set()
    turn = reader
    for name, boxes in sorted(stored.items()):
        out[name] = []
        for box in boxes:
            live = held.get((name, box.box, box.order), [])
            own = [obj for obj in live if live_holder(obj)[0] == reader]
            others = [obj for obj in live if live_holder(obj)[0] != reader]
            if others:
                turn += 1
                others = others[turn % len(others):] + others[: turn % len(others)]
            objects.update(live)
            copies = tuple((obj, 0) for obj in own + others) + box.copies
            out[name].append(StoredBox(box.tensor, box.box, box.order, box.object, box.byte_offset, box.chunks, copies))
    return out, frozenset(objects)


class Assembly:
    """Where one rank's reads land. Each wanted box is allocated once, in its tensor's stored
    dim order; a request's bytes are read into buffers that tile it: straight into a box where
    the bytes are exactly whole rows of it (the common case: nothing is copied after the read),
    into scratch memory elsewhere (widened chunk edges, boxes cut across inner dims), copied
    into place by `finish`."""

    def __init__(self, reads: RankReads, destinations: dict[str, torch.Tensor] | None = None) -> None:
        """`destinations`: tensors to fill in place (this rank's boxes, natural dim order); those
        stored in natural order on the host are read straight into, the rest copied at `finish`."""
        self.reads = reads
        orders = {p.tensor: p.source.order for r in reads.requests for p in r.pieces}
        self.orders = {name: orders.get(name, tuple(range(len(box.lengths)))) for name, box in reads.wanted.items()}
        self.destinations = {n: t for n, t in (destinations or {}).items() if n in reads.wanted}
        self.boxes = {}
        for name, box in reads.wanted.items():
            dest = self.destinations.get(name)
            dtype = torch_dtype(reads.dtypes[name])
            if dest is not None and (tuple(dest.shape) != box.lengths or dest.dtype != dtype):
                raise ValueError(f"{name}: destination {dest.dtype}{list(dest.shape)} for a {dtype}{list(box.lengths)} box")
            natural = self.orders[name] == tuple(range(len(box.lengths)))
            if dest is not None and natural and dest.device.type == "cpu" and dest.is_contiguous():
                self.boxes[name] = dest
            else:
                self.boxes[name] = torch.empty(stored_lengths(box, self.orders[name]), dtype=dtype)
        self._scratch: list[tuple[Piece, torch.Tensor]] = []
        self.targets: list[list[memoryview]] = [[self._target(p) for p in r.pieces] for r in reads.requests]

    def _target(self, piece: Piece) -> memoryview:
        want, src = self.reads.wanted[piece.tensor], piece.source
        itemsize = torch_dtype(piece.dtype).itemsize
        per_row = row_bytes(src.box, src.order, itemsize)
        if _lands_whole(piece, want):
            outer = src.order[0] if src.order else None
            first = 0 if outer is None else piece.cut.offsets[outer] - want.offsets[outer]
            dest = tensor_bytes(self.boxes[piece.tensor])
            return dest[first * per_row : (first + piece.row_end - piece.row_start) * per_row]
        scratch = torch.empty((piece.row_end - piece.row_start) * per_row, dtype=torch.uint8)
        self._scratch.append((piece, scratch))
        return tensor_bytes(scratch)

    def finish(self) -> dict[str, torch.Tensor]:
        """Every wanted box in natural dim order (a permuted view where it was stored permuted),
        once the targets hold their verified bytes."""
        natural = {name: box.permute(_inverse(self.orders[name])) if box.dim() else box for name, box in self.boxes.items()}
        for piece, data in self._scratch:
            src = piece.source
            dtype = torch_dtype(piece.dtype)
            lengths = stored_lengths(src.box, src.order)
            rows = piece.row_end - piece.row_start
            stored = (data.clone() if data.storage_offset() % dtype.itemsize else data).view(dtype)
            stored = stored.reshape((rows, *lengths[1:]) if lengths else ())
            part = stored.permute(_inverse(src.order)) if src.order else stored
            base = list(src.box.offsets)
            if src.order:
                base[src.order[0]] += piece.row_start
            within = tuple(slice(o - b, o - b + n) for o, b, n in zip(piece.cut.offsets, base, piece.cut.lengths, strict=True))
            want = self.reads.wanted[piece.tensor]
            dest = tuple(slice(o - w, o - w + n) for o, w, n in zip(piece.cut.offsets, want.offsets, piece.cut.lengths, strict=True))
            copy_across_transpose(natural[piece.tensor][dest], part[within])
        for name, dest in self.destinations.items():
            if natural[name] is not dest:
                copy_across_transpose(dest, natural[name])
                natural[name] = dest
        return natural


def _lands_whole(piece: Piece, want: Slice) -> bool:
    """Whether the piece's bytes are exactly whole rows of the wanted box in stored order: no
    widened chunk edges, and the same extent as the wanted box on every inner dim."""
    src, order = piece.source, piece.source.order
    if not order:
        return True
    outer = order[0]
    first = piece.cut.offsets[outer] - src.box.offsets[outer]
    if (piece.row_start, piece.row_end) != (first, first + piece.cut.lengths[outer]):
        return False
    return all(
        piece.cut.offsets[d] == want.offsets[d] == src.box.offsets[d]
        and piece.cut.lengths[d] == want.lengths[d] == src.box.lengths[d]
        for d in order[1:]
    )


def _inverse(order: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(order.index(d) for d in range(len(order)))

