"""The communication model: latency + bytes / bandwidth per collective, intra- or inter-node.

Costs follow the ring algorithms NCCL and gloo use: an all-reduce moves 2 (g-1)/g of the
buffer through each device's link, an all-gather (g-1)/g of the result; a layout change is a
point-to-point exchange of the bytes a device lacks. Bandwidths are *per device* link rates.

Point-to-point sends (pipeline stage boundaries) have their own link when measured: a send
involves two processes, where a collective's latency is paid by the slowest of the whole group
step after step (gloo, 4 processes on 2 cores: 0.2-0.6 ms per send against 2-3 ms).
"""

from __future__ import annotations

import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class Link(BaseModel):
    """One level of the network: a fixed cost per collective and a per-device bandwidth."""

    model_config = ConfigDict(extra="forbid")

    latency_s: float = Field(ge=0.0)
    bandwidth_Bps: float = Field(gt=0.0)


class CommModel(BaseModel):
    """Two-level network (intra-node, inter-node); `devices_per_node` decides which a group uses."""

    model_config = ConfigDict(extra="forbid")

    intra: Link
    inter: Link
    devices_per_node: int = Field(default=8, ge=1)
    # DDP's and FSDP's default bucket_cap_mb: gradients are fused and all-reduced in buckets this big.
    gradient_bucket_bytes: int = Field(default=25 * 2**20, ge=1)
    # Point-to-point send/recv between two devices (pipeline stage boundaries), measured on the
    # job's workers; None: sends cost what the collective link says.
    p2p: Link | None = None
    measured: bool = False

    def link(self, intra: bool) -> Link:
        return self.intra if intra else self.inter

    def all_reduce(self, nbytes: float, group: int, intra: bool = True) -> float:
        """Seconds for a ring all-reduce of `nbytes` (per device) over `group` devices."""
        if group <= 1 or nbytes <= 0:
            return 0.0
        link = self.link(intra)
        return link.latency_s + 2.0 * (group - 1) / group * nbytes / link.bandwidth_Bps

    def bucketed_all_reduce(self, nbytes: float, group: int, intra: bool = True) -> float:
        """A gradient's share of bucketed all-reduces (DDP/FSDP fuse gradients into buckets of
        `gradient_bucket_bytes`): full bandwidth, latency only pro rata to the bucket."""
        if group <= 1 or nbytes <= 0:
            return 0.0
        link = self.link(intra)
        return link.latency_s * min(1.0, nbytes / self.gradient_bucket_bytes) + 2.0 * (group - 1) / group * nbytes / link.bandwidth_Bps

    def all_gather(self, out_bytes: float, group: int, intra: bool = True) -> float:
        """Seconds to all-gather a result of `out_bytes` (per device) over `group` devices."""
        if group <= 1 or out_bytes <= 0:
            return 0.0
        link = self.link(intra)
        return link.latency_s + (group - 1) / group * out_bytes / link.bandwidth_Bps

    def transfer(self, nbytes: float, intra: bool = True) -> float:
        """Seconds for a device to receive `nbytes` from one other device, point to point
        (pipeline stage boundaries): the measured p2p link if there is one, else the level's."""
        if nbytes <= 0:
            return 0.0
        link = self.p2p or self.link(intra)
        return link.latency_s + nbytes / link.bandwidth_Bps


# Defaults when nothing is measured. "cuda": NVLink-class H100/H200 nodes, ~450 GB/s per GPU
# intra-node (NVLink 4, unidirectional) and 400 Gb/s InfiniBand per GPU between nodes (~50 GB/s);
# latencies from nccl-tests small-message all-reduce (~10 us intra, ~20 us inter).
# "cpu": gloo over loopback TCP on the 2-core CI machines (~1 GB/s, ~100 us per collective).
DEFAULT_COMM = {
    "cuda": CommModel(intra=Link(latency_s=10e-6, bandwidth_Bps=450e9),
                      inter=Link(latency_s=20e-6, bandwidth_Bps=50e9), devices_per_node=8),
    "cpu": CommModel(intra=Link(latency_s=100e-6, bandwidth_Bps=1e9),
                     inter=Link(latency_s=200e-6, bandwidth_Bps=0.5e9), devices_per_node=64),
}


def default_comm(kind: str, devices_per_node: int | None = None) -> CommModel:
    """The default model for a device kind, optionally with another node size."""
    model = DEFAULT_COMM.get(kind, DEFAULT_COMM["cuda"]).model_copy()
    if devices_per_node is not None:
        model.devices_per_node = devices_per_node
    return model


def _fit(points: list[tuple[float, float]]) -> Link:
    """Least-squares t = latency + bytes / bandwidth over (bytes, seconds) points."""
    import numpy as np

    x = np.array([p[0] for p in points])
    y = np.array([p[1] for p in points])
    slope, intercept = np.polyfit(x, y, 1)
    slope = max(float(slope), 1e-15)
    return Link(latency_s=max(float(intercept), 0.0), bandwidth_Bps=1.0 / slope)


def measure_collectives(group: Any = None, sizes: tuple[int, ...] = (1 << 14, 1 << 18, 1 << 22),
                        repeats: int = 3, devices_per_node: int | None = None) -> CommModel:
    """Time all_reduce and all_gather on a live torch.distributed group; fit latency + bandwidth.
    Also time point-to-point sends (every rank sends to the next and receives from the previous
    at once, as pipeline stages do) and fit the p2p link from them.

    Call it on every rank of the group (it runs collectives). The fitted link is used for both
    levels unless the group spans nodes; per-device bandwidth is backed out of the ring formulas.
    """
    import torch
    import torch.distributed as dist

    g = dist.get_world_size(group)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")
    rank = dist.get_rank(group)

    def peer(k: int) -> int:  # global rank of the group member k places on
        local = (rank + k) % g
        return dist.get_global_rank(group, local) if group is not None else local

    to_next, from_prev = peer(1), peer(-1)
    reduce_pts: list[tuple[float, float]] = []
    gather_pts: list[tuple[float, float]] = []
    p2p_pts: list[tuple[float, float]] = []

    def shift(x: Any, y: Any) -> None:
        if g < 2:
            return
        ops = [dist.P2POp(dist.isend, x, to_next, group), dist.P2POp(dist.irecv, y, from_prev, group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    for size in sizes:
        numel = size // 4
        x = torch.ones(numel, dtype=torch.float32, device=device)
        y = torch.empty_like(x)
        out = [torch.empty_like(x) for _ in range(g)]
        dist.all_reduce(x, group=group)  # warm-up (connects, allocates)
        dist.all_gather(out, x, group=group)
        shift(x, y)
        best_r = best_g = best_p = float("inf")
        for _ in range(repeats):
            dist.barrier(group=group)
            t0 = time.perf_counter()
            shift(x, y)
            if device.type == "cuda":
                torch.cuda.synchronize()
            best_p = min(best_p, time.perf_counter() - t0)
            dist.barrier(group=group)
            t0 = time.perf_counter()
            dist.all_reduce(x, group=group)
            if device.type == "cuda":
                torch.cuda.synchronize()
            best_r = min(best_r, time.perf_counter() - t0)
            dist.barrier(group=group)
            t0 = time.perf_counter()
            dist.all_gather(out, x, group=group)
            if device.type == "cuda":
                torch.cuda.synchronize()
            best_g = min(best_g, time.perf_counter() - t0)
        # Ring volumes: all-reduce 2(g-1)/g * size, all-gather (g-1) * size per device.
        ring = max(g - 1, 1)
        reduce_pts.append((2.0 * ring / max(g, 1) * size, best_r))
        gather_pts.append((float(ring * size), best_g))
        p2p_pts.append((float(size), best_p))
    times = torch.tensor([p[1] for p in reduce_pts + gather_pts + p2p_pts], dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)  # every rank returns the same model
    n = len(reduce_pts)
    reduce_pts = [(b, float(t)) for (b, _), t in zip(reduce_pts, times[:n], strict=True)]
    gather_pts = [(b, float(t)) for (b, _), t in zip(gather_pts, times[n:2 * n], strict=True)]
    p2p_pts = [(b, float(t)) for (b, _), t in zip(p2p_pts, times[2 * n:], strict=True)]
    link = _fit(reduce_pts + gather_pts)
    return CommModel(intra=link, inter=link, devices_per_node=devices_per_node or g, p2p=_fit(p2p_pts) if g > 1 else None,
                     measured=True)
