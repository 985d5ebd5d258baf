"""Layout: for a plan and a model, every tensor's global shape and each rank's slice of it.

A slice is a rectangular box (offsets, lengths) in the global tensor. Several ranks may hold
the same box (data-parallel replicas); a checkpoint writes each distinct box once, by a writer
chosen to balance bytes across ranks, so saving scales with the number of ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod

from ptc.codec import torch_dtype


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
        """Assign every distinct box to one of its holders, largest boxes first, each to the
        holder with the fewest bytes so far (greedy LPT; ties to the lowest rank): deterministic,
        so every rank computes the same assignment without talking to the others."""
        load = [0] * self.world_size
        assignment: dict[tuple[str, Slice], int] = {}
        boxes = self.distinct_slices()
        boxes.sort(key=lambda item: -item[1].numel * self.tensors[item[0]].itemsize)
        for name, box, ranks in boxes:
            writer = min(ranks, key=lambda r: (load[r], r))
            assignment[(name, box)] = writer
            load[writer] += box.numel * self.tensors[name].itemsize
        return assignment

    def slices_to_write(self, rank: int) -> list[tuple[str, Slice]]:
        """The boxes this rank writes in a checkpoint, in a stable order."""
        return sorted(key for key, writer in self.writers().items() if writer == rank)


def data_parallel_layout(
    tensors: dict[str, tuple[tuple[int, ...], str]],
    world_size: int,
    rank_local: dict[str, int] | None = None,
) -> Layout:
    """Every rank holds every tensor whole, except `rank_local` ones (e.g. a rank's RNG state),
    held by one rank only."""
    rank_local = rank_local or {}
    layouts: dict[str, TensorLayout] = {}
    for name, (shape, dtype) in tensors.items():
        box = Slice.whole(shape)
        ranks = [rank_local[name]] if name in rank_local else list(range(world_size))
        layouts[name] = TensorLayout(name, tuple(shape), dtype, {r: box for r in ranks})
    return Layout(world_size, layouts)
