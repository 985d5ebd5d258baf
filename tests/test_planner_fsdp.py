"""The planner's terms for sharded data parallelism (FSDP2): how many all-gathers a step makes
and which unsharded tensors stay in memory, per schedule, and the plan choice between freeing
the gathered weights after forward and keeping them (planner/problem.py `Weights.schedule`,
planner/costs.py)."""

from __future__ import annotations

import numpy as np
import pytest
from parashift.planner.builders import gpt_graph
from parashift.planner.comm import default_comm
from parashift.planner.configs import named_mesh
from parashift.planner.costs import CostModel
from parashift.planner.problem import Weights
from parashift.planner.profile import DEFAULT_DEVICES, profile_graph
from parashift.planner.search import exhaustive_search, plan_model


@pytest.mark.parametrize(("pp", "m", "reshard", "gathers", "holds_weights", "holds_grads"), [
    (1, 1, True, 2, False, False),  # gathered before forward and again before backward
    (1, 1, False, 1, True, False),  # gathered once, held from forward to backward
    (1, 4, True, 8, False, True),  # accumulation: unsharded gradients until the last micro-batch
    (1, 4, False, 4, True, True),
    (2, 4, True, 5, True, True),  # a pipeline stage keeps weights after backward: ~1 per slot
    (2, 4, False, 1, True, True),  # ... and without resharding after forward, once per step
])
def test_schedule_counts_gathers_and_held_tensors(pp: int, m: int, reshard: bool, gathers: int,
                                                  holds_weights: bool, holds_grads: bool) -> None:
    w = Weights.schedule(pp, m, reshard)
    assert (w.gathers, w.holds_weights, w.holds_grads) == (gathers, holds_weights, holds_grads)
    assert (w.weight, w.inflight) == (m + pp - 1, min(m, pp))
    assert Weights.schedule(1, 1) == Weights()  # the unpipelined default


def test_sharded_costs_price_gathers_and_unsharded_tensors() -> None:
    g = gpt_graph(2, 64, 4, 128, 16, 8)
    device, comm = DEFAULT_DEVICES["cuda"], default_comm("cuda", devices_per_node=4)
    replicated = CostModel(g, device, comm, named_mesh(4, 1, 4, g.batch_dim))
    sharded = CostModel(g, device, comm, named_mesh(4, 1, 4, g.batch_dim, shard_dp=True))
    free, held = Weights.schedule(1, 1, True), Weights.schedule(1, 1, False)
    for op in g.ops:
        r, s = replicated.op_cost(op), sharded.op_cost(op)
        assert [c.counts for c in r.configs] == [c.counts for c in s.configs]
        assert np.allclose(s.param_mem, r.param_mem / 4)  # state sharded 4 ways
        assert not (r.gather.any() or r.unsharded_weight.any() or r.unsharded_grad.any())
        if not op.params:
            assert not (s.gather.any() or s.unsharded_weight.any())
            continue
        assert (s.gather > 0).all()
        # the unsharded weight (activation precision) and gradient: param_mem's share of them
        params = s.param_mem * 4 / g.param_state_bytes
        assert np.allclose(s.unsharded_weight, g.act_bytes * params)
        assert np.allclose(s.unsharded_grad, g.grad_bytes * params)
        # keeping the gathered weights saves one gather per evaluation and holds them
        assert np.allclose(free.time(s) - held.time(s), s.gather)
        assert np.allclose(held.memory(s) - free.memory(s), s.unsharded_weight)
        # replicated dp: the schedule changes nothing, but a pipeline stage keeps FSDP2
        # replicate's unsharded copy of its weights for the whole step
        assert np.allclose(free.time(r), held.time(r)) and np.allclose(free.memory(r), held.memory(r))
        assert np.allclose(r.replica_weight, g.act_bytes * params) and not s.replica_weight.any()
        stage = Weights.schedule(2, 1, True)
        assert np.allclose(stage.memory(r) - free.memory(r), r.replica_weight + (stage.inflight - 1) * r.act_mem)


# As memory tightens: replicated dp (fastest), then FSDP keeping the gathered weights (state
# sharded, one gather fewer per evaluation), then FSDP freeing them (least memory). Pipelines
# are left out: tighter still, they fit where FSDP cannot (autocast keeps a bf16 copy of every
# gathered weight until backward, whether FSDP frees the fp32 one or not).
@pytest.mark.parametrize(("fraction", "dp_shard", "reshard"), [(None, 1, True), (0.5, 4, False), (0.4, 4, True)])
def test_memory_decides_between_replicating_keeping_and_freeing(fraction: float | None, dp_shard: int,
                                                                 reshard: bool) -> None:
    """DP and brute force over the same three spaces agree on each step of the way."""
    g = gpt_graph(4, 64, 4, 128, 8, 8)
    prof = profile_graph(g, "cuda", devices_per_node=4)
    limit = None
    if fraction is not None:
        limit = int(plan_model(prof, 4, None, max_tp=1, max_pp=1, shard_dp=False).memory_per_device_bytes * fraction)
    a = plan_model(prof, 4, limit, max_tp=1, max_pp=1)
    b = exhaustive_search(prof, 4, limit, max_tp=1, max_pp=1)
    assert a.estimated_step_s == pytest.approx(b.estimated_step_s, rel=1e-12)
    assert (a.mesh, a.dp_shard, a.reshard_after_forward, a.micro_batches) == (
        b.mesh, b.dp_shard, b.reshard_after_forward, b.micro_batches)
    assert a.feasible and (a.mesh, a.dp_shard, a.reshard_after_forward) == ({"dp": 4}, dp_shard, reshard)
