"""The communication model: latency + bytes / bandwidth per collective, intra- or inter-node.

Costs follow the ring algorithms NCCL and gloo use: an all-reduce moves 2 (g-1)/g of the
buffer through each device's link, an all-gather (g-1)/g of the result; a layout change is a
point-to-point exchange of the bytes a device lacks. Bandwidths are *per device* link rates.

Point-to-point sends (pipeline stage boundaries) have their own link when measured: a send
involves two processes, where a collective's latency is paid by the slowest of the whole group
step after step (gloo, 4 processes on 2 cores: 0.2-0.6 ms per send against 2-3 ms).
"""

from __future__ import annotations

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


def comm_model_from_timings(timings: dict[str, Any], devices_per_node: int | None = None) -> CommModel:
    """Fit latency + bandwidth to collectives timed on live workers (`trainer.measure_comm`:
    {"group_size": g, "all_reduce" | "all_gather" | "p2p": [[bytes, seconds], ...]}).

    Per-device volumes follow the ring formulas: all-reduce 2(g-1)/g x size, all-gather
    (g-1) x size; point-to-point sends (pipeline stage boundaries) get a link of their own. On
    one node the fitted link serves both levels; timed across nodes (`trainer.measure_comm`
    with "intra" and "inter" groups) each level gets its own, and sends the inter-node one
    (pipeline stages sit on different nodes first: pp is the outermost axis).
    """
    if "inter" in timings:  # timed on a job across nodes: each level fitted on its own
        inter, p2p = _fit_level(timings["inter"])
        intra = _fit_level(timings["intra"])[0] if timings.get("intra") else inter
        return CommModel(intra=intra, inter=inter, devices_per_node=int(timings["devices_per_node"]), p2p=p2p,
                         measured=True)
    link, p2p = _fit_level(timings)
    return CommModel(intra=link, inter=link, devices_per_node=devices_per_node or int(timings["group_size"]),
                     p2p=p2p, measured=True)


def _fit_level(timings: dict[str, Any]) -> tuple[Link, Link | None]:
    """The collective link and the point-to-point link of one group's timings."""
    g = int(timings["group_size"])
    ring = max(g - 1, 1)
    reduce_pts = [(2.0 * ring / max(g, 1) * size, t) for size, t in timings["all_reduce"]]
    gather_pts = [(float(ring * size), t) for size, t in timings["all_gather"]]
    p2p = _fit([(float(size), t) for size, t in timings["p2p"]]) if g > 1 else None
    return _fit(reduce_pts + gather_pts), p2p
