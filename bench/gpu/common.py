"""What every part of the GPU check shares: its arguments, its JSON lines, its device helpers.

A part prints one JSON object per line for each case (`emit`), and only those on stdout: the
workers' chatter goes to stderr. A case that fails prints its own line with `ok: false` and the
error, so the cases after it still run (`case`)."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

# NVIDIA H200 SXM datasheet: dense BF16 tensor-core peak (the MFU denominator).
H200_BF16_DENSE_FLOPS = 989e12


def part_args(description: str | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="toy sizes: checks the code, not the GPU")
    parser.add_argument("--dir", type=Path, required=True, help="a scratch folder on the disk to measure")
    parser.add_argument("--inputs", type=Path, default=None, help="the prepared folder (bench.gpu_check --prepare)")
    return parser.parse_args()


def emit(part: str, case: str, **fields: Any) -> dict[str, Any]:
    line = {"part": part, "case": case, **fields}
    print(json.dumps(line, default=str), flush=True)
    return line


@contextlib.contextmanager
def case(part: str, name: str) -> Iterator[dict[str, Any]]:
    """Run one case: what it puts in the yielded dict is printed as its line (`ok: true`); an
    exception prints the line with `ok: false`, the error and the end of its traceback instead."""
    fields: dict[str, Any] = {}
    started = time.perf_counter()
    try:
        yield fields
    except Exception as error:  # noqa: BLE001 - one case's failure must not cost the others
        tail = traceback.format_exc().strip().splitlines()[-12:]
        print("\n".join(tail), file=sys.stderr, flush=True)
        emit(part, name, **{**fields, "ok": False, "error": f"{type(error).__name__}: {error}"[:2000],
                            "traceback": tail, "seconds": round(time.perf_counter() - started, 2)})
    else:
        emit(part, name, **{"ok": True, **fields, "seconds": round(time.perf_counter() - started, 2)})


def synced(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def free_cuda() -> None:
    """Between cases in one process: what the last case cached goes back, its peak is forgotten."""
    import gc

    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
