"""The banded copy across a transposition is exact for every shape, dtype and band edge."""

import pytest
import torch
from parashift.ptc.transpose import BAND, copy_across_transpose


@pytest.mark.parametrize("rows, cols", [(1, 1), (3, 5), (BAND, BAND), (257, BAND * 3 + 7), (2048, 96), (96, 2048)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_banded_copy_equals_plain_copy(rows: int, cols: int, dtype: torch.dtype) -> None:
    source = torch.arange(rows * cols).reshape(cols, rows).to(dtype)
    expected = source.t().contiguous()
    out = torch.full((rows, cols), -1).to(dtype)
    assert copy_across_transpose(out, source.t()) is out
    assert torch.equal(out, expected)


def test_into_a_strided_slice_of_a_larger_tensor() -> None:
    big = torch.zeros(300, 500)
    source = torch.randn(400, 300)  # its transpose is [300, 400]
    copy_across_transpose(big[:, 50:450], source.t())
    assert torch.equal(big[:, 50:450], source.t())
    assert not big[:, :50].any() and not big[:, 450:].any()


def test_other_layouts_fall_back_to_copy() -> None:
    source = torch.randn(4, 5, 6).permute(2, 0, 1)
    out = torch.empty(6, 4, 5)
    assert torch.equal(copy_across_transpose(out, source), source)
