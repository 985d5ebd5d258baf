"""Parallelizable tensor collections: codec, layouts, and assembling boxes from stored slices."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ptc import (
    Layout,
    Slice,
    TensorLayout,
    assemble_region,
    bytes_to_tensor,
    data_parallel_layout,
    dtype_name,
    tensor_to_bytes,
)


def test_codec_round_trips_every_dtype() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool):
        tensor = (torch.arange(24) % 3).to(dtype).reshape(2, 3, 4)
        back = bytes_to_tensor(tensor_to_bytes(tensor), dtype_name(dtype), [2, 3, 4])
        assert back.dtype == dtype and torch.equal(back, tensor)
    scalar = torch.tensor(5.0)
    assert torch.equal(bytes_to_tensor(tensor_to_bytes(scalar), "float32", []), scalar)


def test_codec_refuses_wrong_sizes() -> None:
    import pytest

    with pytest.raises(ValueError, match="cannot hold"):
        bytes_to_tensor(b"\0" * 7, "float32", [2])


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


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 9),
    cols=st.integers(1, 9),
    row_cut=st.integers(0, 9),
    col_cut=st.integers(0, 9),
    data=st.data(),
)
def test_any_box_assembles_from_a_tiling(rows: int, cols: int, row_cut: int, col_cut: int, data: st.DataObject) -> None:
    """Resharded == unsharded slice: any wanted box built from a 2x2 tiling equals the slice."""
    full = torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols)
    rc, cc = min(row_cut, rows), min(col_cut, cols)
    tiles = [
        Slice((r0, c0), (r1 - r0, c1 - c0))
        for r0, r1 in ((0, rc), (rc, rows))
        for c0, c1 in ((0, cc), (cc, cols))
        if r1 > r0 and c1 > c0
    ]
    r0 = data.draw(st.integers(0, rows - 1))
    c0 = data.draw(st.integers(0, cols - 1))
    wanted = Slice((r0, c0), (data.draw(st.integers(1, rows - r0)), data.draw(st.integers(1, cols - c0))))

    def load(indices: list[int]) -> list[torch.Tensor]:
        return [full[t.offsets[0] : t.offsets[0] + t.lengths[0], t.offsets[1] : t.offsets[1] + t.lengths[1]].clone() for t in (tiles[i] for i in indices)]

    got = assemble_region(wanted, tiles, load, torch.float32)
    assert torch.equal(got, full[r0 : r0 + wanted.lengths[0], c0 : c0 + wanted.lengths[1]])


def test_uncovered_box_is_an_error() -> None:
    import pytest

    with pytest.raises(ValueError, match="cover"):
        assemble_region(Slice((0,), (4,)), [Slice((0,), (2,))], lambda idx: [torch.zeros(2)], torch.float32)


def test_layout_distinct_slices_groups_replicas() -> None:
    layout = Layout(2, {"w": TensorLayout("w", (4,), "float32", {0: Slice((0,), (4,)), 1: Slice((0,), (4,))})})
    assert layout.distinct_slices() == [("w", Slice((0,), (4,)), [0, 1])]
