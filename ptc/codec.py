"""Tensors as raw little-endian bytes plus (dtype, shape) in JSON: no pickle ever reaches storage."""

from __future__ import annotations

import sys

import torch

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "bool": torch.bool,
}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("parashift stores tensors little-endian and supports only little-endian hosts")


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _NAMES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot be stored; supported: {sorted(_DTYPES)}") from None


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown stored dtype {name!r}; supported: {sorted(_DTYPES)}") from None


def tensor_to_bytes(tensor: torch.Tensor) -> bytes:
    """The tensor's elements in row-major order, as stored bytes."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes()


def bytes_to_tensor(data: bytes, dtype: str, shape: tuple[int, ...] | list[int]) -> torch.Tensor:
    """Rebuild a tensor from stored bytes; the size is checked against dtype and shape."""
    target = torch_dtype(dtype)
    numel = 1
    for size in shape:
        numel *= size
    expected = numel * torch.empty((), dtype=target).element_size()
    if len(data) != expected:
        raise ValueError(f"{len(data)} bytes cannot hold a {dtype} tensor of shape {tuple(shape)} ({expected} bytes)")
    if numel == 0:
        return torch.empty(tuple(shape), dtype=target)
    # bytearray: frombuffer needs a writable buffer to hand out a tensor that owns its memory.
    return torch.frombuffer(bytearray(data), dtype=target).reshape(tuple(shape))
