"""GEMM time by shape: measured on this device against the planner's cost model.

The planner costs a GEMM as the larger of its FLOPs at the device's GEMM rate (scaled by the wave
efficiency of its output shape, `DeviceModel.gemm_efficiency`) and its bytes at memory bandwidth.
This times GEMMs over the shapes a GPT's layers take per device (rows: tokens per micro-batch
on one device; inner and output widths: d_model and its multiples, split by tensor
parallelism) and reports, per shape, measured / modelled, for the model with wave efficiency and
for a flat rate (efficiency 1, the roofline alone), side by side.

    OMP_NUM_THREADS=1 python -m bench.gemm_shapes [--device cpu|cuda]

Last line: one JSON object; `median_abs_log2_error` is the typical factor (2**x) by which each
model misses.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time

import torch
from parashift.planner.profile import measure_device

SHAPES = {
    "cpu": [(m, k, n) for m in (16, 64, 256, 1024, 4096) for k, n in ((128, 128), (128, 512), (512, 128), (1024, 1024))],
    "cuda": [(m, k, n) for m in (512, 1024, 4096, 16384) for k, n in
             ((1024, 1024), (1024, 4096), (4096, 1024), (1024, 3072), (4096, 4096), (12288, 1536))],
}


def time_gemm(m: int, k: int, n: int, device: torch.device, dtype: torch.dtype, repeats: int = 7) -> float:
    a = torch.randn(m, k, device=device, dtype=dtype)
    b = torch.randn(k, n, device=device, dtype=dtype)
    times = []
    for _ in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(10):
            a @ b
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / 10)
    return min(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = measure_device(args.device)
    flat = model.model_copy(update={"gemm_tile": (1, 1), "gemm_units": 1})
    size = torch.empty((), dtype=dtype).element_size()
    rows, errors = [], {"wave": [], "flat": []}
    for m, k, n in SHAPES[args.device]:
        measured = time_gemm(m, k, n, device, dtype)
        entry = {"m": m, "k": k, "n": n, "measured_s": measured}
        for name, dev in (("wave", model), ("flat", flat)):
            modelled = max(2.0 * m * k * n / (dev.matmul_flops * dev.gemm_efficiency(1, m, n)),
                           size * (m * k + k * n + m * n) / dev.memory_Bps)
            entry[f"{name}_model_s"] = modelled
            errors[name].append(abs(math.log2(measured / modelled)))
        rows.append(entry)
        print(f"{m:6d} x {k:5d} x {n:5d}: measured {measured * 1e6:9.1f} us, wave model {entry['wave_model_s'] * 1e6:9.1f},"
              f" flat {entry['flat_model_s'] * 1e6:9.1f}", flush=True)
    print(json.dumps({
        "benchmark": "gemm_shapes", "device": args.device, "machine": platform.machine(),
        "name": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor(),
        "matmul_flops": model.matmul_flops, "memory_Bps": model.memory_Bps, "gemm_units": model.gemm_units,
        "gemm_tile": model.gemm_tile, "op_overhead_s": model.op_overhead_s,
        "median_abs_log2_error": {name: statistics.median(e) for name, e in errors.items()},
        "max_abs_log2_error": {name: max(e) for name, e in errors.items()}, "shapes": rows,
    }))


if __name__ == "__main__":
    main()
