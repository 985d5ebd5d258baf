"""Checkpoints without processes: a distinct value in every element of a layout's tensors,
saved as each rank of the layout would save its boxes."""

from __future__ import annotations

import torch
from parashift.ptc import Layout
from parashift.ptc.layout import Slice
from parashift.storage import CheckpointStore
from parashift.trainer.checkpoint import Checkpointer, build_manifest


def global_state(layout: Layout) -> dict[str, torch.Tensor]:
    """A distinct value in every element of every tensor."""
    out = {}
    for i, (name, t) in enumerate(sorted(layout.tensors.items())):
        dtype = torch.uint8 if t.dtype == "uint8" else torch.float32
        values = torch.arange(i * 100_000, i * 100_000 + max(1, torch.Size(t.shape).numel()), dtype=torch.float64)
        out[name] = (values % 251 if dtype == torch.uint8 else values).to(dtype).reshape(t.shape)
    return out


def box_of(tensor: torch.Tensor, box: Slice) -> torch.Tensor:
    return tensor[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.lengths, strict=True))]


def save_all_ranks(store: CheckpointStore, layout: Layout, state: dict[str, torch.Tensor], step: int,
                   previous_step: int | None = None) -> None:
    """What the ranks of `layout` would write, done one rank after another in this process."""
    objects, records = [], []
    for rank in range(layout.world_size):
        mine = {name: box_of(state[name], box).clone() for name, box in layout.boxes_of(rank).items()}
        payloads = Checkpointer(store, layout, rank).snapshot(mine)
        obj, recs = store.write_rank_object(step, rank, payloads)
        objects += [obj] if obj else []
        records += recs
    store.commit(build_manifest(store.job_id, step, layout, objects, records, {"samples_consumed": step * 8}, {}, {},
                                previous_step=previous_step))
