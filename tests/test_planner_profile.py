"""Profiles: measured device rates, measured collectives on real torch.distributed workers."""

from __future__ import annotations

import os
import time

import pytest
import torch.multiprocessing as mp
from parashift.planner.comm import CommModel, default_comm
from parashift.planner.profile import profile_gpt


def test_profile_gpt_measures_this_device_quickly() -> None:
    t0 = time.perf_counter()
    prof = profile_gpt(2, 64, 4, 256, 32, 4, "cpu", measure=True)
    assert time.perf_counter() - t0 < 10.0
    assert prof.device.measured and prof.device.matmul_flops > 1e8 and prof.device.memory_Bps > 1e8
    assert prof.n_params == prof.graph.n_params > 0 and prof.flops_per_token > 0


@pytest.mark.parametrize("omp", [None, "3"])
def test_cpu_rates_are_timed_with_one_worker_s_threads(omp: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU workers compute on OMP_NUM_THREADS threads (1 unless set: launcher.launch), so the rates
    are timed on that many, whatever this process's torch uses (every core: each worker's GEMM
    rate read 2x on 2 cores), and this process's setting is left as it was."""
    import torch
    from parashift.planner.profile import measure_device

    if omp is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    seen: list[int] = []
    randn = torch.randn
    monkeypatch.setattr(torch, "randn", lambda *a, **k: (seen.append(torch.get_num_threads()), randn(*a, **k))[1])
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        measure_device("cpu", repeats=1)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert seen and set(seen) == {int(omp or 1)}


def test_mfu_peak_on_cpu_is_measured_even_where_the_profile_holds_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    """A data-parallel job's profile keeps the default CPU rates (nothing to choose), but its MFU
    is against a GEMM rate measured here (an 80% MFU read against the default on a fast host),
    at each worker's core share; a measured profile's own rate serves as it is."""
    from parashift.planner import profile
    from parashift.planner.profile import DEFAULT_DEVICES, peak_flops, share_cores

    monkeypatch.setattr(profile, "cpu_gemm_flops", lambda: 120e9)
    assert peak_flops(share_cores(DEFAULT_DEVICES["cpu"], 4, cores=2)) == pytest.approx(60e9)
    assert peak_flops(share_cores(DEFAULT_DEVICES["cpu"], 2, cores=2)) == pytest.approx(120e9)
    measured = DEFAULT_DEVICES["cpu"].model_copy(update={"matmul_flops": 80e9, "measured": True})
    assert peak_flops(measured) == 80e9
    assert peak_flops(DEFAULT_DEVICES["cuda"]) == DEFAULT_DEVICES["cuda"].matmul_flops


def test_comm_model_costs() -> None:
    comm = default_comm("cuda", devices_per_node=8)
    assert comm.all_reduce(1e6, 1) == 0.0
    assert comm.all_reduce(1e9, 8, intra=True) < comm.all_reduce(1e9, 8, intra=False)
    assert comm.all_gather(1e9, 4) < comm.all_reduce(1e9, 4)


def _worker(rank: int, world: int, path: str, out: dict) -> None:
    import torch.distributed as dist
    from parashift.planner.comm import comm_model_from_timings
    from parashift.trainer.measure_comm import time_collectives

    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    try:
        model = comm_model_from_timings(time_collectives(sizes=(1 << 12, 1 << 16, 1 << 20), repeats=2))
        out[rank] = model.model_dump_json()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_measure_collectives_on_gloo_workers(tmp_path) -> None:
    manager = mp.Manager()
    out = manager.dict()
    mp.spawn(_worker, args=(2, str(tmp_path / "store"), out), nprocs=2, join=True)
    models = [CommModel.model_validate_json(out[r]) for r in range(2)]
    assert models[0] == models[1]  # every rank agrees (max over ranks)
    link = models[0].intra
    assert models[0].measured and link.bandwidth_Bps > 1e6 and link.latency_s < 0.1
    p2p = models[0].p2p  # point-to-point sends, fitted on their own (pipeline stage boundaries)
    assert p2p is not None and p2p.bandwidth_Bps > 1e6 and p2p.latency_s < 0.1
    assert models[0].transfer(1e6) == p2p.latency_s + 1e6 / p2p.bandwidth_Bps


def test_timings_across_nodes_give_each_level_its_own_link() -> None:
    """trainer.measure_comm across nodes reports a group within a node and one across nodes;
    the fit keeps them apart (exact on noiseless timings: t = latency + bytes / bandwidth)."""
    from parashift.planner.comm import comm_model_from_timings

    def level(g: int, latency: float, bandwidth: float) -> dict:
        sizes = (1 << 12, 1 << 16, 1 << 20)
        ring = g - 1
        return {"group_size": g,
                "all_reduce": [[s, latency + 2 * ring / g * s / bandwidth] for s in sizes],
                "all_gather": [[s, latency + ring * s / bandwidth] for s in sizes],
                "p2p": [[s, latency / 2 + s / bandwidth] for s in sizes]}

    timings = {"group_size": 8, "nodes": 2, "devices_per_node": 4,
               "intra": level(4, 1e-5, 100e9), "inter": level(2, 5e-5, 10e9)}
    comm = comm_model_from_timings(timings)
    assert comm.devices_per_node == 4 and comm.measured
    assert comm.intra.latency_s == pytest.approx(1e-5, rel=1e-3) and comm.intra.bandwidth_Bps == pytest.approx(100e9, rel=1e-3)
    assert comm.inter.latency_s == pytest.approx(5e-5, rel=1e-3) and comm.inter.bandwidth_Bps == pytest.approx(10e9, rel=1e-3)
    assert comm.p2p is not None and comm.p2p.bandwidth_Bps == pytest.approx(10e9, rel=1e-3)  # sends cross nodes
    # one node per worker group: no "intra" group, both levels are the inter-node link
    single = comm_model_from_timings({**timings, "devices_per_node": 1, "intra": None})
    assert single.intra == single.inter
