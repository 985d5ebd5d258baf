"""ModelProfile: the graph plus what this device kind computes and communicates per second.

Measured rates replace the defaults when `measure=True`: a few GEMMs and one large elementwise op
timed on this machine (a couple of seconds on CPU). Collectives are measured on real workers
(`trainer.measure_comm`), fitted by `planner.comm.comm_model_from_timings` and passed in as `comm`.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from parashift.planner.builders import gpt_graph
from parashift.planner.comm import CommModel, default_comm
from parashift.planner.graph import Graph
from pydantic import BaseModel, ConfigDict, Field, PositiveInt

if TYPE_CHECKING:
    import torch


class DeviceModel(BaseModel):
    """Roofline of one device: GEMM rate for matmul-like ops, memory bandwidth for the rest."""

    model_config = ConfigDict(extra="forbid")

    kind: str = "cuda"
    matmul_flops: float = Field(gt=0.0, description="sustained FLOP/s of large GEMMs")
    memory_Bps: float = Field(gt=0.0, description="device memory bandwidth, bytes/s")
    memory_bytes: int | None = Field(default=None, description="memory per device (None: unlimited)")
    op_overhead_s: float = Field(
        default=0.0, ge=0.0, description="fixed seconds per op evaluation (dispatch, autograd, hooks) a roofline leaves out"
    )
    sharded_op_overhead_s: float = Field(
        default=0.0, ge=0.0,
        description="extra fixed seconds per evaluation of an op split along a non-batch dim (DTensor dispatch, sharding propagation)",
    )
    host_async: bool = Field(
        default=False,
        description="the host queues kernels ahead of the device (CUDA): an op costs the larger of its device time "
        "and its host overhead, not their sum (CPU workers compute on the thread that dispatches)")
    gemm_tile: tuple[PositiveInt, PositiveInt] = Field(
        default=(1, 1), description="output tile (rows, columns) one compute unit takes at a time in a GEMM")
    gemm_units: PositiveInt = Field(default=1, description="compute units that run GEMM tiles side by side (SMs)")
    core_share: float = Field(
        default=1.0, gt=0.0, le=1.0,
        description="fraction of a core each worker gets while every worker is busy (CPU workers outnumbering "
        "cores, see share_cores); the rates and overheads above already include it",
    )
    measured: bool = False

    def gemm_efficiency(self, batch: int, rows: int, cols: int) -> float:
        """Fraction of the GEMM rate a (batch x rows x cols)-output GEMM gets from whole tiles
        and whole waves: tiles are padded to full size and run in waves of `gemm_units`, so
        a GEMM of 64 tiles on 132 SMs keeps half of them idle (wave quantization)."""
        tile_rows, tile_cols = self.gemm_tile
        tiles = batch * -(-rows // tile_rows) * -(-cols // tile_cols)
        waves = -(-tiles // self.gemm_units)
        return batch * rows * cols / (waves * self.gemm_units * tile_rows * tile_cols)


# H200: 989 TFLOP/s dense bf16 peak; eager GPT-2 reaches 31-47% (measured on an H200), so 40% sustained
# by GEMMs of whole waves; HBM3e 4.8 TB/s at ~70% achievable; 132 SMs, GEMM tiles of 128 x 128 (a
# typical cuBLAS bf16 tile; smaller GEMMs lose to wave quantization). Host overhead: eager PyTorch
# spends some 5-10 us of host time per aten op (dispatch, autograd recording) and a module-level op
# runs about 4-6 of them forward and backward, so 40 us per evaluation; DTensor's sharding
# propagation adds about 100 us. Both are estimates until measured on the GPU
# (`measure_device("cuda")` times the first; BENCHMARKS.md, GPU check). CPU: the 2-core CI
# machines (fp32 MKL GEMM ~50 GFLOP/s).
# op_overhead_s, cpu: 0.16 ms of one core per op evaluation, and sharded_op_overhead_s, cpu:
# 4.5 ms per evaluation of a tensor-parallel op, both fitted to measured step times of 14 plans
# on 4 gloo workers on 2 cores (BENCHMARKS.md, cost-model fidelity: 0.32 ms and 9 ms there, with
# each worker getting half a core; share_cores scales them back).
DEFAULT_DEVICES = {
    "cuda": DeviceModel(kind="cuda", matmul_flops=0.4 * 989e12, memory_Bps=0.7 * 4.8e12, memory_bytes=141 * 2**30,
                        op_overhead_s=4e-5, sharded_op_overhead_s=1e-4, host_async=True, gemm_tile=(128, 128),
                        gemm_units=132),
    "cpu": DeviceModel(kind="cpu", matmul_flops=50e9, memory_Bps=5e9, memory_bytes=None, op_overhead_s=1.6e-4,
                       sharded_op_overhead_s=4.5e-3),
}


def share_cores(device: DeviceModel, workers: int, cores: int | None = None) -> DeviceModel:
    """A CPU device as each of `workers` processes on `cores` cores sees it while all are busy:
    rates measured by one process on an idle core shrink by cores/workers when workers outnumber
    cores, and fixed per-op CPU costs grow by workers/cores. `core_share` records the share, so
    that a pipeline's idle stages can hand their core to the busy ones (planner.pipeline)."""
    import os

    cores = cores or os.cpu_count() or 1
    if device.kind != "cpu":
        return device
    share = min(1.0, cores / workers)
    scale = share / device.core_share  # relative to what the device already holds: idempotent
    if scale == 1.0:
        return device
    return device.model_copy(update={
        "matmul_flops": device.matmul_flops * scale, "memory_Bps": device.memory_Bps * scale,
        "op_overhead_s": device.op_overhead_s / scale, "sharded_op_overhead_s": device.sharded_op_overhead_s / scale,
        "core_share": share})


class ModelProfile(BaseModel):
    """What the search needs: the op graph, the device's rates and the communication model."""

    model_config = ConfigDict(extra="forbid")

    name: str = "model"
    n_params: int
    flops_per_token: float = Field(description="training FLOPs per token (forward + backward)")
    graph: Graph
    device: DeviceModel
    comm: CommModel
    shard_dp: bool = Field(default=False, description="search with the dp axis sharding parameter state (FSDP)")
    reshard_after_forward: bool = Field(
        default=True, description="sharded dp: search with FSDP freeing gathered weights after forward (False: "
                                  "gathered once per evaluation, or once per step in a pipeline, and held)")
    activation_checkpointing: str = Field(
        default="none", description="the checkpointing the graph's layers are priced under (planner/checkpointing.py)")
    data_axis: bool | None = Field(
        default=None, description="the meshes searched by their data axis: True only dp > 1, False only dp = 1, "
                                  "None every one (a graph priced under FSDP2's bf16 policy holds only where there "
                                  "is a data axis: planner/checkpointing.py `policy_on`)")


def cpu_worker_threads() -> int:
    """The threads one CPU worker computes with: OMP_NUM_THREADS, which the launcher sets to 1
    where it is unset (`launcher.launch.worker_env`: several workers share the cores)."""
    try:
        return max(1, int(os.environ.get("OMP_NUM_THREADS") or 1))
    except ValueError:
        return 1


@contextlib.contextmanager
def _as_a_worker(dev: torch.device) -> Iterator[None]:
    """Time on CPU with a worker's threads, not this process's: a flow process's torch uses every
    core, so its GEMMs ran 2x (on 2 cores; 16x on 16) faster than any worker's, and the planner
    and MFU took that for each worker's rate."""
    import torch

    if dev.type != "cpu":
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(cpu_worker_threads())
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _best_s(fn: Callable[[], object], dev: torch.device, repeats: int) -> float:
    import torch

    fn()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    out = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        out = min(out, time.perf_counter() - t0)
    return out


def _gemm_flops(dev: torch.device, sizes: tuple[int, ...], repeats: int) -> float:
    """The best rate of square GEMMs of `sizes` (bf16 on a GPU, fp32 on CPU), best of `repeats`."""
    import torch

    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    rate = 0.0
    for n in sizes:
        a = torch.randn(n, n, device=dev, dtype=dtype)
        b = torch.randn(n, n, device=dev, dtype=dtype)
        rate = max(rate, 2.0 * n**3 / _best_s(lambda a=a, b=b: a @ b, dev, repeats))
    return rate


@functools.cache
def cpu_gemm_flops() -> float:
    """A CPU worker's GEMM rate on an idle core, measured once per process (~0.1 s): GEMMs of a
    few ms at most, best of 10, so a core busy with other processes meanwhile still leaves
    some uninterrupted. MFU's denominator on CPU where the profile holds default rates."""
    import torch

    cpu = torch.device("cpu")
    with _as_a_worker(cpu):
        return _gemm_flops(cpu, (256, 512, 768), repeats=10)


def peak_flops(device: DeviceModel) -> float:
    """Each device's GEMM peak for MFU: the profile's rate where measured (or on a GPU, whose
    trainer takes its data sheet's), else on CPU one measured here, at the device's core share."""
    if device.kind == "cpu" and not device.measured:
        return cpu_gemm_flops() * device.core_share
    return device.matmul_flops


def measurable_here(kind: str) -> bool:
    """Whether this process can time a `kind` device: a CUDA job's flow (or `parashift plan`) may
    run on a head node without GPUs."""
    import torch

    return kind != "cuda" or torch.cuda.is_available()


def measure_device(kind: str = "cpu", repeats: int = 3) -> DeviceModel:
    """Time GEMMs of 256..1024 and a large add (beyond the caches) on this process's device, on
    CPU with one worker's threads (`cpu_worker_threads`); best-of-`repeats`. ValueError for a
    device this process has none of (it timed the CPU for CUDA before: an 8B Llama planned at
    1e4 s per step with unlimited memory)."""
    import torch

    if not measurable_here(kind):
        raise ValueError(f"no {kind} device here to measure (torch.cuda.is_available() is False)")
    dev = torch.device(kind)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    with _as_a_worker(dev):
        rate = _gemm_flops(dev, (256, 512, 1024) if dev.type == "cpu" else (2048, 4096, 8192), repeats)
        # Well beyond the last-level cache (32 MiB L3 on the CI machines, 50 MB L2 on an H200): with
        # 16 MiB the figure swung between 5 and 85 GB/s from run to run with what else held the cache.
        x = torch.randn(1 << 25, device=dev, dtype=dtype)
        bw = 3.0 * x.numel() * x.element_size() / _best_s(lambda x=x: x + x, dev, repeats)  # two reads, one write
    default = DEFAULT_DEVICES.get(kind, DEFAULT_DEVICES["cuda"])
    update: dict[str, object] = {"kind": kind, "matmul_flops": rate, "memory_Bps": bw, "memory_bytes": None,
                                 "measured": True}
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        update.update(memory_bytes=props.total_memory, gemm_units=props.multi_processor_count,
                      op_overhead_s=host_overhead_s(dev))
    # On CPU the per-op overheads stay the ones fitted to measured step times (a tiny op timed
    # alone misses what 4 workers on 2 cores pay: BENCHMARKS.md, cost-model fidelity).
    return default.model_copy(update=update)


def host_overhead_s(device: object, repeats: int = 200) -> float:
    """Host seconds of one module-level op's forward and backward in eager PyTorch: a tiny
    linear, so the device keeps up and the loop runs at the speed of dispatch and autograd."""
    import torch

    layer = torch.nn.Linear(8, 8, device=device)
    x = torch.randn(8, 8, device=device, requires_grad=True)

    def loop(n: int) -> None:
        for _ in range(n):
            layer(x).sum().backward()

    loop(10)
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    loop(repeats)
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize(device)
    return elapsed / repeats


def profile_graph(graph: Graph, device_kind: str = "cuda", measure: bool = False, *,
                  memory_gb: float | None = None, devices_per_node: int | None = None,
                  comm: CommModel | None = None, tokens: int | None = None,
                  device: DeviceModel | None = None) -> ModelProfile:
    """A profile for any graph: measured or default device rates (or `device`'s, measured
    before), given or default comm model."""
    if device is None:
        device = measure_device(device_kind) if measure else DEFAULT_DEVICES.get(device_kind, DEFAULT_DEVICES["cuda"])
    device = device.model_copy()
    if memory_gb is not None:
        device.memory_bytes = int(memory_gb * 2**30)
    comm = comm or default_comm(device_kind, devices_per_node)
    per_token = 3.0 * graph.flops / tokens if tokens else 0.0
    return ModelProfile(name=graph.name, n_params=graph.n_params, flops_per_token=per_token, graph=graph,
                        device=device, comm=comm)


def profile_gpt(n_layers: int, d_model: int, n_heads: int, vocab_size: int, seq_len: int, batch: int,
                device_kind: str = "cuda", measure: bool = False, *, memory_gb: float | None = None,
                devices_per_node: int | None = None, comm: CommModel | None = None,
                precision: str = "bf16") -> ModelProfile:
    """Profile a GPT: its module-level graph for one global batch (at the trainer's `precision`:
    what activations weigh and what autograd keeps), rates, comm model."""
    graph = gpt_graph(n_layers, d_model, n_heads, vocab_size, seq_len, batch, precision=precision)
    return profile_graph(graph, device_kind, measure, memory_gb=memory_gb, devices_per_node=devices_per_node,
                         comm=comm, tokens=batch * seq_len)
