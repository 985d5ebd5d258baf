"""Stored dtypes by name: tensors are raw little-endian bytes, their dtype and shape in JSON, so no
pickle ever reaches storage."""

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


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A contiguous host tensor's memory as bytes, without copying (any dtype, 0-d included)."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown stored dtype {name!r}; supported: {sorted(_DTYPES)}") from None
