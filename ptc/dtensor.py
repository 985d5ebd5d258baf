"""Layouts from live tensors: a DTensor's box of its global tensor comes from its placements
through torch's own local-shape/offset helper, so the Layout agrees with what DTensor (and
FSDP2, which shards through DTensor) really holds, uneven splits included. A plain tensor is
held whole.

Checkpoints compute Layouts from the plan (`trainer.layout`); these helpers let a rank check
that its live tensors hold the boxes that Layout says.
"""

from __future__ import annotations

import torch
from parashift.ptc.codec import dtype_name
from parashift.ptc.layout import Slice
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

# tensor name -> (global shape, dtype name, this rank's box)
Holdings = dict[str, tuple[tuple[int, ...], str, Slice]]


def local_box(tensor: torch.Tensor) -> tuple[tuple[int, ...], Slice]:
    """(global shape, the box of it this rank holds)."""
    shape = tuple(tensor.shape)
    if isinstance(tensor, DTensor):
        lengths, offsets = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
        return shape, Slice(tuple(offsets), tuple(lengths))
    return shape, Slice.whole(shape)


def local_data(tensor: torch.Tensor) -> torch.Tensor:
    """The elements of this rank's box, as a plain tensor."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def holdings(state: dict[str, torch.Tensor]) -> Holdings:
    """This rank's box of every tensor it holds; empty boxes (uneven shards) are left out."""
    out: Holdings = {}
    for name, tensor in state.items():
        shape, box = local_box(tensor)
        if box.numel > 0 or not shape:
            out[name] = (shape, dtype_name(tensor.dtype), box)
    return out
