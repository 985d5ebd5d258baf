"""Configurations: which mesh axes split which iteration dims of an op.

Two spaces share one representation (per op dim, the tuple of mesh-axis indices splitting it):

- *mesh* (what Plans execute): a named device mesh ("dp", "tp") of given sizes; each axis
  splits one dim of the op or replicates it; several axes may split one dim (nested, mesh
  order). Every such configuration is a DTensor placement per tensor: Shard(i) where an axis
  splits tensor axis i, Partial where it splits a dim the tensor lacks and that is summed away
  (outputs), Replicate otherwise.
- *counts* (PaSE's space, for its benchmark): any per-dim split counts whose product divides p;
  the mesh is p's prime factors and layouts are assumed aligned, as PaSE's cost model does.

On a mesh, ops may restrict what the "tp" axis splits (`Op.tp_dims`, `Op.tp_required`,
planner/graph.py): configurations outside that are never generated. The counts space has no
"tp" axis and ignores these fields.

Uneven splits are pruned, but one: DTensor can shard unevenly, yet sequence parallelism crashes
on uneven sequence splits (torch 2.13, measured). The exception is the batch over "dp" alone,
which the trainer splits into shares that differ by one sample (16 sequences on 3 ranks: 6, 5,
5); the cost model charges each rank the largest share (`costs.rank_shares`). It used to replicate
such an op over "dp" instead: every rank computing the whole batch, 3x the cost, a replicated
layout shown for what runs as data parallelism, and no baseline on 3 devices.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from itertools import product
from math import prod

from parashift.planner.graph import Op

# The mesh axis that op-level tp restrictions (`Op.tp_dims`, tie groups) speak about.
TP = "tp"


@dataclass(frozen=True)
class Mesh:
    """The devices one stage's ops are spread over: axes outermost first, sizes > 1 only."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]
    aligned: bool = False  # counts space: layouts assumed nested (PaSE's model)
    devices_per_node: int = 8
    batch_only: tuple[str, ...] = ()  # axes that may split only the batch dim (or replicate)
    batch_dim: str = "b"
    full: bool = False  # counts space: every op uses all devices (no replicated compute)
    shard_dp: bool = False  # the "dp" axis shards parameter state (FSDP / ZeRO-3) instead of replicating it

    @property
    def devices(self) -> int:
        return prod(self.sizes)

    @cached_property
    def spans(self) -> tuple[int, ...]:
        """Rank distance covered by each axis (size x stride, the innermost axis has stride 1)."""
        out, stride = [], 1
        for size in reversed(self.sizes):
            out.append(size * stride)
            stride *= size
        return tuple(reversed(out))

    def group(self, axes: set[int] | frozenset[int] | tuple[int, ...]) -> tuple[int, bool]:
        """Size of the group of devices that differ only along `axes`, and whether it is in one node."""
        if not axes:
            return 1, True
        size = prod(self.sizes[a] for a in axes)
        if self.aligned:
            return size, size <= self.devices_per_node
        return size, max(self.spans[a] for a in axes) <= self.devices_per_node


def named_mesh(dp: int, tp: int, devices_per_node: int = 8, batch_dim: str = "b", shard_dp: bool = False) -> Mesh:
    """The ("dp", "tp") mesh of a stage; axes of size 1 are dropped.

    "dp" splits only the batch: what data parallelism means to the trainer. The weights are
    replicated over it (gradient all-reduce) or, `shard_dp`, sharded over it (FSDP: gathered
    for each use, gradients reduce-scattered). "tp" may split any dim, the batch too.
    """
    axes = [(n, s) for n, s in (("dp", dp), ("tp", tp)) if s > 1]
    return Mesh(tuple(n for n, _ in axes), tuple(s for _, s in axes), False, devices_per_node, ("dp",), batch_dim,
                shard_dp=shard_dp and dp > 1)


def _prime_factors(n: int) -> list[int]:
    out, f = [], 2
    while f * f <= n:
        while n % f == 0:
            out.append(f)
            n //= f
        f += 1
    if n > 1:
        out.append(n)
    return out


def counts_mesh(p: int, devices_per_node: int = 8, full: bool = False) -> Mesh:
    """PaSE's space: p's prime factors as axes, layouts aligned; `full`: split products equal p."""
    factors = _prime_factors(p) if p > 1 else []
    return Mesh(tuple(f"x{i}" for i in range(len(factors))), tuple(factors), True, devices_per_node, full=full)


@dataclass(frozen=True)
class Config:
    """Per op dim (in `op.dims` order): the mesh axes that split it, and the resulting counts."""

    axes: tuple[tuple[int, ...], ...]
    counts: tuple[int, ...]

    def splits(self, op: Op, mesh: Mesh) -> dict[str, tuple[str, ...]]:
        """dim -> mesh axis names, only for split dims (the OpPlacement form)."""
        return {d: tuple(mesh.names[a] for a in ax) for d, ax in zip(op.dims, self.axes, strict=True) if ax}

    def label(self, op: Op, mesh: Mesh) -> str:
        parts = [f"{d}/{'x'.join(mesh.names[a] for a in ax) if not mesh.aligned else c}"
                 for d, ax, c in zip(op.dims, self.axes, self.counts, strict=True) if c > 1]
        return " ".join(parts) or "replicated"


def _splittable(op: Op) -> list[int]:
    return [i for i, d in enumerate(op.dims) if d not in op.nosplit and op.dims[d] > 1]


def axis_targets(op: Op, mesh: Mesh, name: str) -> list[int | None]:
    """What mesh axis `name` may split in `op`: dim indices, None for nothing (replicated).

    "dp"-like axes (`mesh.batch_only`) split the batch dim of every op that has one, as data
    parallelism does (an op replicated over dp would compute the same samples twice, which the
    trainer never does); ops without a batch dim are replicated. The axis named "tp" splits
    only the op's `tp_dims` (when declared), and must split one when `tp_required`.
    """
    names = list(op.dims)
    dims = _splittable(op)
    if name in mesh.batch_only:
        return [i for i in dims if names[i] == mesh.batch_dim] or [None]
    if name == TP and op.tp_dims is not None:
        dims = [i for i in dims if names[i] in op.tp_dims]
    return dims if name == TP and op.tp_required else [None, *dims]


def splits_on(config: Config, axis: int) -> bool:
    """Whether the configuration splits some dim over mesh axis index `axis`."""
    return any(axis in ax for ax in config.axes)


def mesh_configs(op: Op, mesh: Mesh) -> list[Config]:
    """Each assignment of each mesh axis to one allowed dim (or none), keeping even splits.

    Axes may split only what `axis_targets` allows: the restriction is applied here, at
    generation, so the search never sees a layout the op does not declare. A `tp_required` op
    with no even split over "tp" has no configuration at all (the caller avoids that state, or
    that mesh: planner/outer.py `_Context.configurable`).
    The batch may split unevenly over "dp" alone (the trainer's shares differ by one); where
    there are more ranks than samples, the op is replicated over "dp" instead.
    """
    targets = [axis_targets(op, mesh, n) for n in mesh.names]
    return _even_configs(op, mesh, targets) or _even_configs(
        op, mesh, [[None] if n in mesh.batch_only else t for n, t in zip(mesh.names, targets, strict=True)])


def _even_configs(op: Op, mesh: Mesh, targets: list[list[int | None]]) -> list[Config]:
    sizes = list(op.dims.values())
    names = list(op.dims)
    out = []
    for choice in product(*targets):
        axes: list[list[int]] = [[] for _ in sizes]
        for a, dim in enumerate(choice):
            if dim is not None:
                axes[dim].append(a)
        counts = tuple(prod(mesh.sizes[a] for a in ax) for ax in axes)
        if all(n % c == 0 or _shares(names[i], axes[i], n, c, mesh) for i, (n, c) in enumerate(zip(sizes, counts,
                                                                                                     strict=True))):
            out.append(Config(tuple(tuple(ax) for ax in axes), counts))
    return out


def _shares(dim: str, axes: list[int], n: int, c: int, mesh: Mesh) -> bool:
    """Whether `n` items of `dim` split `c` ways unevenly is a layout the trainer runs: the batch
    over data-parallel axes alone, each rank at least one sample."""
    return dim == mesh.batch_dim and c <= n and all(mesh.names[a] in mesh.batch_only for a in axes)


def count_configs(op: Op, mesh: Mesh) -> list[Config]:
    """Every vector of per-dim split counts dividing the dims, with a product dividing p."""
    sizes = list(op.dims.values())
    split = set(_splittable(op))
    p = mesh.devices
    vectors: list[tuple[int, ...]] = []

    def walk(i: int, left: int, acc: tuple[int, ...]) -> None:
        if i == len(sizes):
            if left == 1 or not mesh.full:
                vectors.append(acc)
            return
        for c in range(1, left + 1):
            if left % c == 0 and sizes[i] % c == 0 and (c == 1 or i in split):
                walk(i + 1, left // c, (*acc, c))

    walk(0, p, ())
    out = []
    for counts in vectors:
        free = list(range(len(mesh.sizes)))
        axes = []
        for c in counts:  # hand out prime axes to each dim (bookkeeping; layouts are aligned)
            ax: list[int] = []
            while c > 1:
                a = next(a for a in free if c % mesh.sizes[a] == 0)
                free.remove(a)
                ax.append(a)
                c //= mesh.sizes[a]
            axes.append(tuple(ax))
        out.append(Config(tuple(axes), counts))
    return out


def op_configs(op: Op, mesh: Mesh) -> list[Config]:
    """The configuration space of an op on a mesh (see module docstring)."""
    return count_configs(op, mesh) if mesh.aligned else mesh_configs(op, mesh)


def dtensor_placements(op: Op, config: Config, mesh: Mesh) -> dict[str, tuple[str, ...]]:
    """Per tensor of the op ("in0".., "out", "param0"..), one DTensor placement per mesh axis."""
    owner = {a: d for d, ax in zip(op.dims, config.axes, strict=True) for a in ax}

    def place(tensor: tuple[str, ...], partial_ok: bool) -> tuple[str, ...]:
        out = []
        for a in range(len(mesh.sizes)):
            dim = owner.get(a)
            if dim is not None and dim in tensor:
                out.append(f"Shard({tensor.index(dim)})")
            elif dim is not None and partial_ok:  # a split dim the output lacks is summed away
                out.append("Partial()")
            else:
                out.append("Replicate()")
        return tuple(out)

    result = {f"in{i}": place(t, False) for i, t in enumerate(op.inputs)}
    result["out"] = place(op.output, True)
    result.update({f"param{i}": place(t, False) for i, t in enumerate(op.params)})
    return result
