"""Profiles: measured device rates, measured collectives on real torch.distributed workers."""

from __future__ import annotations

import os
import time

import pytest
import torch.multiprocessing as mp

from planner.comm import CommModel, default_comm
from planner.profile import profile_gpt


def test_profile_gpt_measures_this_device_quickly() -> None:
    t0 = time.perf_counter()
    prof = profile_gpt(2, 64, 4, 256, 32, 4, "cpu", measure=True)
    assert time.perf_counter() - t0 < 10.0
    assert prof.device.measured and prof.device.matmul_flops > 1e8 and prof.device.memory_Bps > 1e8
    assert prof.n_params == prof.graph.n_params > 0 and prof.flops_per_token > 0


def test_comm_model_costs() -> None:
    comm = default_comm("cuda", devices_per_node=8)
    assert comm.all_reduce(1e6, 1) == 0.0
    assert comm.all_reduce(1e9, 8, intra=True) < comm.all_reduce(1e9, 8, intra=False)
    assert comm.all_gather(1e9, 4) < comm.all_reduce(1e9, 4)


def _worker(rank: int, world: int, path: str, out: dict) -> None:
    import torch.distributed as dist

    from planner.comm import comm_model_from_timings
    from trainer.measure_comm import time_collectives

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
