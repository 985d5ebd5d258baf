"""Parallelizable tensor collections (after Tenplex, SOSP 2024): every piece of training state
as a named global tensor, and which slice of it each rank holds under a plan."""

from ptc.codec import bytes_to_tensor, dtype_name, tensor_to_bytes
from ptc.layout import Layout, Slice, TensorLayout, data_parallel_layout
from ptc.regions import assemble_region, intersect

__all__ = [
    "Layout",
    "Slice",
    "TensorLayout",
    "assemble_region",
    "bytes_to_tensor",
    "data_parallel_layout",
    "dtype_name",
    "intersect",
    "tensor_to_bytes",
]
