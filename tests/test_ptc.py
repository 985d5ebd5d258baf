"""Parallelizable tensor collections: codec, layouts, and assembling boxes from stored slices."""

from __future__ import annotations

import torch
from parashift.ptc import Layout, Slice, TensorLayout, data_parallel_layout, dtype_name, intersect
from parashift.ptc.codec import torch_dtype
from parashift.ptc.layout import TensorPlacement, mesh_coordinates, mesh_layout, shard_extent


def test_dtype_names_round_trip_and_unknown_ones_are_refused() -> None:
    import pytest

    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool):
        assert torch_dtype(dtype_name(dtype)) == dtype
    with pytest.raises(ValueError, match="unknown stored dtype"):
        torch_dtype("float128")


def test_mesh_ranks_are_numbered_as_device_mesh_does() -> None:
    """Row-major over ("pp", "dp", "tp"), as init_device_mesh lays ranks out."""
    coords = mesh_coordinates({"pp": 2, "dp": 2, "tp": 2})
    assert coords[5] == {"pp": 1, "dp": 0, "tp": 1} and len(coords) == 8


def test_shard_extents_are_torchs() -> None:
    """ptc's copy of torch's Shard rule (layouts need not load torch.distributed.tensor) cuts
    every size as torch does, uneven and empty parts included."""
    from torch.distributed.tensor import Shard

    for size in range(40):
        for parts in range(1, 10):
            for index in range(parts):
                length, offset = Shard.local_shard_size_and_offset(size, parts, index)
                assert shard_extent(size, parts, index) == (int(length), int(offset)), (size, parts, index)


def test_mesh_layout_shards_by_torch_rule_and_places_stages() -> None:
    layout = mesh_layout({"pp": 2, "tp": 3}, {
        "w": TensorPlacement((10, 4), "float32", stage=1, tp_dim=0),  # 10 rows over 3: 4, 4, 2
        "b": TensorPlacement((4,), "float32", stage=0),
    })
    assert layout.tensors["w"].holders == {3: Slice((0, 0), (4, 4)), 4: Slice((4, 0), (4, 4)), 5: Slice((8, 0), (2, 4))}
    assert sorted(layout.tensors["b"].holders) == [0, 1, 2]
    assert intersect(Slice((0,), (4,)), Slice((4,), (2,))) is None


def test_replicated_slices_are_written_once_and_balanced() -> None:
    tensors = {f"t{i}": ((100 * (i + 1),), "float32") for i in range(6)}
    layout = data_parallel_layout(tensors, world_size=3)
    written = [layout.slices_to_write(r) for r in range(3)]
    flat = [key for per_rank in written for key in per_rank]
    assert sorted(name for name, _ in flat) == sorted(tensors)  # each exactly once
    loads = [sum(box.numel for _, box in per_rank) for per_rank in written]
    assert max(loads) - min(loads) <= 600  # greedy LPT: within the largest tensor


def test_rank_local_tensors_are_written_by_their_rank() -> None:
    layout = data_parallel_layout({"rng/a": ((8,), "uint8"), "w": ((4,), "float32")}, 2, rank_local={"rng/a": 1})
    assert ("rng/a", Slice((0,), (8,))) in layout.slices_to_write(1)


def test_layout_distinct_slices_groups_replicas() -> None:
    layout = Layout(2, {"w": TensorLayout("w", (4,), "float32", {0: Slice((0,), (4,)), 1: Slice((0,), (4,))})})
    assert layout.distinct_slices() == [("w", Slice((0,), (4,)), [0, 1])]


def test_the_first_ranks_cover_the_most_of_the_state_a_subset_of_their_size_can() -> None:
    """`Layout.covering_ranks`: the warm processes a job keeps when it shrinks. For a GPT's state
    under meshes of pp, tp, dp and FSDP, the first k ranks hold as many distinct bytes as the
    best k ranks (every subset tried), and once k reaches the number of distinct holdings, all
    of the state: after pp 2 x dp 2, ranks 0 and 1 held stage 0 twice."""
    from itertools import combinations

    from jobs import mesh_plan, tiny_spec
    from parashift.trainer.layout import state_layout

    model = tiny_spec("cover", "memory://cover", model={"n_layers": 2}).model
    meshes = [({"pp": 2, "dp": 2}, {"micro_batches": 2}), ({"dp": 2, "tp": 2}, {}), ({"pp": 2, "tp": 2}, {"micro_batches": 2}),
              ({"dp": 4}, {"dp_shard": 2}), ({"pp": 2, "dp": 4}, {"micro_batches": 2, "dp_shard": 2})]
    for mesh, fields in meshes:
        layout = state_layout(mesh_plan(mesh, **fields), model)
        size = {(n, b): b.numel * layout.tensors[n].itemsize for n, b, _ in layout.distinct_slices()}
        held = {r: {(n, b) for n, b in layout.boxes_of(r).items()} for r in range(layout.world_size)}

        def covered(ranks, held=held, size=size):
            return sum(size[k] for k in set().union(*(held[r] for r in ranks)))

        for k in range(1, layout.world_size + 1):
            order = layout.covering_ranks(k)
            assert sorted(order) == list(range(layout.world_size))
            best = max(covered(c) for c in combinations(range(layout.world_size), k))
            assert covered(order[:k]) == best, (mesh, k, order)
    # Two ranks of pp 2 x dp 2 hold the whole model and optimizer state (a rank's generator
    # state is its own; warm workers keep every rank's, a few KB: trainer.checkpoint.live.hold).
    pp = state_layout(mesh_plan({"pp": 2, "dp": 2}, micro_batches=2), model)
    kept = pp.covering_ranks(2)[:2]
    state = {(n, b) for n, b, _ in pp.distinct_slices() if not n.startswith("rng/")}
    assert state <= {(n, b) for r in kept for n, b in pp.boxes_of(r).items()}, kept
    assert not state <= {(n, b) for r in (0, 1) for n, b in pp.boxes_of(r).items()}  # the first two did not
