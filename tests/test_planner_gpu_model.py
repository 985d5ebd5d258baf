"""What a GPU's cost model charges that a roofline alone misses: GEMMs that do not fill whole
waves of tiles, and the host's fixed cost per op, which a device fed asynchronously hides behind
large kernels but not behind small ones. Together they make micro-batches cost what they do."""

from __future__ import annotations

import pytest
from parashift.planner.builders import gpt_graph
from parashift.planner.comm import default_comm
from parashift.planner.configs import named_mesh
from parashift.planner.costs import CostModel, gemm_output_dims
from parashift.planner.profile import DEFAULT_DEVICES, profile_gpt
from parashift.planner.search import plan_model

CUDA, CPU = DEFAULT_DEVICES["cuda"], DEFAULT_DEVICES["cpu"]


def test_wave_efficiency() -> None:
    assert CUDA.gemm_efficiency(1, 1024, 1024) == pytest.approx(64 / 132)  # 64 tiles: half the SMs idle
    assert CUDA.gemm_efficiency(1, 128 * 12, 128 * 11) == 1.0  # exactly one wave of whole tiles
    assert CUDA.gemm_efficiency(1, 100, 128) == pytest.approx(100 / 128 / 132)  # a padded tile alone
    assert CUDA.gemm_efficiency(132, 128, 128) == 1.0  # a batch of tiles fills the wave as well
    assert CPU.gemm_efficiency(1, 3, 5) == 1.0  # CPU: no tiles to pad, no waves


def test_gemm_output_dims() -> None:
    g = gpt_graph(1, 64, 4, 128, 16, 2)
    assert gemm_output_dims(g.op("l0.qkv")) == ((), ("b", "s"), ("h", "q"))
    assert gemm_output_dims(g.op("l0.attn")) is None  # fused attention: one packed operand


def _compute(graph, device, op: str) -> float:
    return float(CostModel(graph, device, default_comm("cuda"), named_mesh(1, 1)).op_cost(graph.op(op)).compute[0])


def test_host_overhead_hides_behind_the_device_only_when_fed_asynchronously() -> None:
    g = gpt_graph(1, 64, 4, 128, 16, 1)  # a tiny op: host bound
    tiny = _compute(g, CUDA, "l0.add1")
    assert tiny == pytest.approx(CUDA.op_overhead_s)  # the larger of the two, the host's
    synchronous = CUDA.model_copy(update={"host_async": False})
    assert _compute(g, synchronous, "l0.add1") > tiny
    big = gpt_graph(1, 4096, 32, 128, 2048, 8)
    assert _compute(big, CUDA, "l0.fc1") == pytest.approx(
        _compute(big, CUDA.model_copy(update={"op_overhead_s": 0.0}), "l0.fc1"))  # hidden behind the GEMM


def test_micro_batches_of_one_sequence_are_not_free() -> None:
    """GPT-2 medium's compute for 64 sequences: in one evaluation, in 8 micro-batches of 8, in 64
    of one. A roofline alone costs all three the same."""
    def per_step(micro: int) -> float:
        g = gpt_graph(24, 1024, 16, 50304, 1024, 64 // micro)
        costs = CostModel(g, CUDA, default_comm("cuda"), named_mesh(1, 1))
        return micro * sum(float(costs.op_cost(op).compute[0]) for op in g.ops)

    whole, eights, ones = per_step(1), per_step(8), per_step(64)
    assert eights < 1.05 * whole
    assert ones > 1.5 * whole


@pytest.mark.parametrize("devices", [16, 32, 64])
def test_gpt2_medium_on_gpus_is_not_cut_into_single_sequence_micro_batches(devices: int) -> None:
    """With micro-batches free, GPT-2 medium at 16-64 GPUs was pipelined with 64 micro-batches of
    one sequence each, where data parallelism (with tp inside a node) is what experts run."""
    plan = plan_model(profile_gpt(24, 1024, 16, 50304, 1024, 512, "cuda"), devices)
    sequences = 512 // plan.degree("dp") // plan.micro_batches
    assert sequences >= 4, (plan.mesh, plan.micro_batches)
    assert plan.degree("dp") >= devices // 4
