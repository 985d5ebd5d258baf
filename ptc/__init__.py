"""Parallelizable tensor collections (after Tenplex, SOSP 2024): every piece of training state
as a named global tensor, which slice of it each rank holds under a plan, how slices are
stored, and what a new plan's ranks read from a checkpoint (`reshard_plan`, from its manifest
alone)."""

from parashift.ptc.codec import dtype_name
from parashift.ptc.layout import Layout, Slice, TensorLayout, data_parallel_layout, mesh_layout
from parashift.ptc.regions import intersect
from parashift.ptc.reshard import check_usable, reshard_plan

__all__ = [
    "Layout",
    "Slice",
    "TensorLayout",
    "check_usable",
    "data_parallel_layout",
    "dtype_name",
    "intersect",
    "mesh_layout",
    "reshard_plan",
]
