"""Layout: for a plan and a model, every tensor's global shape and each rank's slice of it.

A slice is a rectangular box (offsets, lengths) in the global tensor. Several ranks may hold
the same box (data-parallel replicas); a checkpoint writes each distinct box once, by a writer
chosen to balance bytes across ranks, so saving scales with the number of ranks.

`mesh_layout` computes a Layout without any process: from the mesh shape and, per tensor, the
pipeline stage that holds it and the mesh axis (if any) that shards it along which dim. Boxes
follow torch's own Shard rule (`Shard.local_shard_size_and_offset`, uneven splits included;
`shard_extent`, checked against it by tests/test_ptc.py), so the Layout equals what DTensor
really holds; the trainer checks that at start. Computing it here keeps torch.distributed.tensor
out of whatever only plans (a Layout, a reshard plan).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod

from parashift.ptc.codec import torch_dtype

# Mesh axes, outermost first, in the order torch's DeviceMesh numbers ranks (row-major).
MESH_AXES = ("pp", "dp", "tp")


@dataclass(frozen=True, order=True)
class Slice:
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]

    @classmethod
    def whole(cls, shape: tuple[int, ...]) -> Slice:
        return cls(tuple(0 for _ in shape), tuple(shape))

    @property
    def numel(self) -> int:
        return prod(self.lengths)


@dataclass
class TensorLayout:
    name: str
    shape: tuple[int, ...]
    dtype: str
    # rank -> the box of the global tensor that rank holds
    holders: dict[int, Slice] = field(default_factory=dict)
    # The dim that plans split (tensor parallelism), or None. Checkpoints store every box of
    # the tensor with this dim outermost, so a box cut along it under any other degree is one
    # contiguous byte range of a stored box (ptc.storage_order).
    split_dim: int | None = None

    @property
    def itemsize(self) -> int:
        return torch_dtype(self.dtype).itemsize


@dataclass
class Layout:
    world_size: int
    tensors: dict[str, TensorLayout]

    def distinct_slices(self) -> list[tuple[str, Slice, list[int]]]:
        """Each distinct (tensor, box) with the ranks holding it, in a stable order."""
        out: list[tuple[str, Slice, list[int]]] = []
        for name in sorted(self.tensors):
            by_box: dict[Slice, list[int]] = {}
            for rank, box in sorted(self.tensors[name].holders.items()):
                by_box.setdefault(box, []).append(rank)
            out.extend((name, box, ranks) for box, ranks in sorted(by_box.items()))
        return out

    def writers(self) -> dict[tuple[str, Slice], int]:
        """Assign every distinct box to one of its holders, costliest boxes first, each to the
        holder with the least work so far (greedy LPT; ties to the lowest rank): deterministic,
        so every rank computes the same assignment without talking to the others. A box's work
        is its bytes, twice that where it is stored permuted (the permutation is a second pass
        over it; see `ptc.chunks.storage_order`)."""
        load = [0] * self.world_size
        assignment: dict[tuple[str, Slice], int] = {}
        boxes = self.distinct_slices()
        boxes.sort(key=lambda item: -self._write_cost(item[0], item[1]))
        for name, box, ranks in boxes:
            writer = min(ranks, key=lambda r: (load[r], r))
            assignment[(name, box)] = writer
            load[writer] += self._write_cost(name, box)
        return assignment

    def _write_cost(self, name: str, box: Slice) -> int:
        tensor = self.tensors[name]
        permuted = tensor.split_dim not in (None, 0) and len(tensor.shape) > 1
        return box.numel * tensor.itemsize * (2 if permuted else 1)

    def slices_to_write(self, rank: int) -> list[tuple[str, Slice]]:
        """The boxes this rank writes in a checkpoint, in a stable order."""
        return self.slices_by_writer().get(rank, [])

    def slices_by_writer(self) -> dict[int, list[tuple[str, Slice]]]:
        """Every writing rank's boxes (`slices_to_write`), from one assignment: what describes
        every rank's part of a checkpoint at once (a held step's pending manifest)."""
        out: dict[int, list[tuple[str, Slice]]] = {}
        for key, writer in sorted(self.writers().items()):
            out.setdefault(writer, []).append(key)
        return out

    def covering_ranks(self, count: int) -> list[int]:
        """Every rank, ordered so that the first `count` hold as many of the state's distinct
        bytes as any `count` ranks greedily can: each next, the rank adding the most bytes no
        rank before it holds (ties to the lowest). A job keeping `count` of these ranks' warm
        processes keeps that much of its step in memory: after pp 2 x dp 2, the first two ranks
        hold stage 0 twice, one rank of each stage holds everything."""
        held: dict[int, set[tuple[str, Slice]]] = {r: set() for r in range(self.world_size)}
        size: dict[tuple[str, Slice], int] = {}
        for name, box, ranks in self.distinct_slices():
            size[(name, box)] = box.numel * self.tensors[name].itemsize
            for rank in ranks:
                held[rank].add((name, box))
        order: list[int] = []
        covered: set[tuple[str, Slice]] = set()
        for _ in range(min(count, self.world_size)):
            best = max((r for r in held if r not in order),
                       key=lambda r: (sum(size[k] for k in held[r] - covered), -r))
            order.append(best)
            covered |= held[best]
        return order + [r for r in range(self.world_size) if r not in order]

    def boxes_of(self, rank: int) -> dict[str, Slice]:
        """Every box `rank` holds, by tensor name."""
        return {name: t.holders[rank] for name, t in self.tensors.items() if rank in t.holders}


@dataclass(frozen=True)
class TensorPlacement:
    """Where one global tensor lives under a plan: its shape and dtype, the pipeline stage that
    holds it (None: every stage), the dim the "tp" axis shards (None: replicated), the dim the
    sharded part of the "dp" axis shards within each tp box (FSDP; None: replicated over dp),
    the one rank that holds it alone (a rank's RNG state), if any."""

    shape: tuple[int, ...]
    dtype: str
    stage: int | None = None
    tp_dim: int | None = None
    dp_dim: int | None = None
    rank: int | None = None
    # The dim any plan may shard (stored outermost in checkpoints), whether or not this one does.
    split_dim: int | None = None


def mesh_coordinates(mesh: dict[str, int]) -> list[dict[str, int]]:
    """Each rank's coordinate on every axis of a ("pp", "dp", "tp") mesh (absent axes: size 1)."""
    sizes = [mesh.get(axis, 1) for axis in MESH_AXES]
    coords = []
    for rank in range(prod(sizes)):
        coord, rest = {}, rank
        for axis, size in zip(reversed(MESH_AXES), reversed(sizes), strict=True):
            coord[axis] = rest % size
            rest //= size
        coords.append(coord)
    return coords


def shard_extent(size: int, parts: int, index: int) -> tuple[int, int]:
    """(length, offset) of part `index` of `parts` along a dim of `size` elements, by torch's
    Shard rule (`Shard.local_shard_size_and_offset`, torch.chunk's cut): parts of ceil(size /
    parts) elements, the last ones shorter or empty."""
    full = -(-size // parts)
    offset = min(size, full * index)
    return min(size, offset + full) - offset, offset


def shard_box(shape: tuple[int, ...], dim: int, parts: int, index: int) -> Slice:
    """Box `index` of `parts` along `dim`, by torch's Shard rule (ceil-sized chunks, the last
    ones shorter or empty)."""
    length, offset = shard_extent(shape[dim], parts, index)
    offsets = tuple(offset if d == dim else 0 for d in range(len(shape)))
    lengths = tuple(length if d == dim else n for d, n in enumerate(shape))
    return Slice(offsets, lengths)


def shard_within(box: Slice, dim: int, parts: int, index: int) -> Slice:
    """Part `index` of `parts` of `box` along `dim`, by the same rule: FSDP's chunk of a rank's
    tensor-parallel shard (torch.chunk, which FSDP2 uses, cuts as Shard does)."""
    length, offset = shard_extent(box.lengths[dim], parts, index)
    offsets = tuple(o + offset if d == dim else o for d, o in enumerate(box.offsets))
    lengths = tuple(length if d == dim else n for d, n in enumerate(box.lengths))
    return Slice(offsets, lengths)


def mesh_layout(mesh: dict[str, int], tensors: dict[str, TensorPlacement], dp_shard: int = 1) -> Layout:
    """The Layout of a collection under a mesh, computed without processes. `dp_shard`: the dp
    axis is (dp / dp_shard replicas) x (dp_shard shards), row-major. Empty boxes (uneven
    shards) are left out, as DTensor holds no elements there."""
    coords = mesh_coordinates(mesh)
    tp = mesh.get("tp", 1)
    layouts: dict[str, TensorLayout] = {}
    for name, where in tensors.items():
        shape = tuple(where.shape)
        split = where.tp_dim if tp > 1 else None
        layout = TensorLayout(name, shape, where.dtype, split_dim=where.tp_dim if where.split_dim is None else where.split_dim)
        for rank, coord in enumerate(coords):
            if where.rank is not None and where.rank != rank:
                continue
            if where.stage is not None and where.stage != coord["pp"]:
                continue
            box = Slice.whole(shape) if split is None else shard_box(shape, split, tp, coord["tp"])
            if dp_shard > 1 and where.dp_dim is not None:
                box = shard_within(box, where.dp_dim, dp_shard, coord["dp"] % dp_shard)
            if box.numel > 0 or not shape:
                layout.holders[rank] = box
        layouts[name] = layout
    return Layout(len(coords), layouts)


def data_parallel_layout(
    tensors: dict[str, tuple[tuple[int, ...], str]],
    world_size: int,
    rank_local: dict[str, int] | None = None,
) -> Layout:
    """Every rank holds every tensor whole, except `rank_local` ones (e.g. a rank's RNG state),
    held by one rank only."""
    rank_local = rank_local or {}
    placements = {
        name: TensorPlacement(tuple(shape), dtype, rank=rank_local.get(name)) for name, (shape, dtype) in tensors.items()
    }
    return mesh_layout({"dp": world_size}, placements)
