"""The cost model's terms for CPU workers: point-to-point stage boundaries, and pipelines on
workers that outnumber the cores (planner/comm.py, planner/profile.py, planner/pipeline.py)."""

from __future__ import annotations

import pytest
from parashift.planner import search
from parashift.planner.comm import CommModel, Link
from parashift.planner.outer import enumerate_specs, evaluate
from parashift.planner.pipeline import step_time
from parashift.planner.problem import OpBreakdown, Weights
from parashift.planner.profile import DEFAULT_DEVICES, ModelProfile, profile_gpt, share_cores
from parashift.planner.search import plan_model
from parashift.planner.stage import Candidate, StageResult

COLLECTIVE = Link(latency_s=3e-3, bandwidth_Bps=1e9)
P2P = Link(latency_s=2e-4, bandwidth_Bps=1e9)


def _on_mesh(profile: ModelProfile, pp: int, dp: int, tp: int, pipelined: bool = True) -> list[Candidate]:
    """The search's candidates on one mesh, every one evaluated: pipelined (incl. gradient
    accumulation, which the search skips where the single stage fits) or the single stage."""
    specs = enumerate_specs(profile, pp * dp * tp, None, None, None, "dp")
    return [evaluate(s) for s in specs if (s.pp, s.dp, s.tp) == (pp, dp, tp) and (s.layout is not None) == pipelined]


def _comm(p2p: Link | None) -> CommModel:
    return CommModel(intra=COLLECTIVE, inter=COLLECTIVE, devices_per_node=4, p2p=p2p, measured=True)


def test_point_to_point_sends_use_the_p2p_link_when_measured() -> None:
    assert _comm(None).transfer(1e6) == pytest.approx(3e-3 + 1e-3)  # the collective link
    assert _comm(P2P).transfer(1e6) == pytest.approx(2e-4 + 1e-3)
    assert _comm(P2P).transfer(1e6, intra=False) == pytest.approx(2e-4 + 1e-3)
    assert _comm(P2P).transfer(0.0) == 0.0
    # collectives keep their own link
    assert _comm(P2P).all_reduce(1e6, 4) == _comm(None).all_reduce(1e6, 4)
    # a comm model cached before p2p existed still loads
    old = _comm(None).model_dump()
    del old["p2p"]
    assert CommModel.model_validate(old).p2p is None


def _profile(p2p: Link | None = None, workers: int | None = 4, cores: int = 2):
    prof = profile_gpt(4, 128, 4, 256, 48, 16, "cpu", comm=_comm(p2p))
    if workers is not None:
        prof = prof.model_copy(update={"device": share_cores(prof.device, workers, cores)})
    return prof


def test_stage_boundaries_pay_the_p2p_latency_not_a_collectives() -> None:
    slow, fast = _profile(None, None), _profile(P2P, None)  # a core per worker: boundaries only differ
    for pp, dp, tp in ((4, 1, 1), (2, 2, 1)):
        a = {c.micro_batches: c.time_s for c in _on_mesh(slow, pp, dp, tp)}
        b = {c.micro_batches: c.time_s for c in _on_mesh(fast, pp, dp, tp)}
        for m in a:
            # 2 sends (activation, gradient) per micro-batch slot; every replica's send pays latency
            saved = (COLLECTIVE.latency_s - P2P.latency_s) * 2.0 * (m + pp - 1)
            assert a[m] - b[m] == pytest.approx(saved, rel=1e-6)


def test_share_cores_scales_rates_and_overheads_and_records_the_share() -> None:
    cpu = DEFAULT_DEVICES["cpu"]
    shared = share_cores(cpu, 4, 2)
    assert shared.core_share == 0.5
    assert shared.matmul_flops == cpu.matmul_flops / 2 and shared.memory_Bps == cpu.memory_Bps / 2
    assert shared.op_overhead_s == cpu.op_overhead_s * 2
    assert shared.sharded_op_overhead_s == cpu.sharded_op_overhead_s * 2
    assert share_cores(shared, 4, 2) == shared  # idempotent
    assert share_cores(cpu, 2, 2) == cpu  # a core each: nothing shared
    assert share_cores(cpu, 2, 8) == cpu
    assert share_cores(DEFAULT_DEVICES["cuda"], 64, 2) == DEFAULT_DEVICES["cuda"]


def _stage(compute: float, comm: float, weight: float) -> StageResult:
    rows = [OpBreakdown(compute, comm, 0.0)]
    return StageResult(None, None, [0], Weights(weight=weight), rows)  # type: ignore[arg-type]


def test_step_time_bounds() -> None:
    # 4 stages, 4 micro-batches (weight 7), 70 ms of compute at the shared rate each, 1 ms comm
    stages = [_stage(0.070, 0.001, 7.0) for _ in range(4)]
    assert step_time(stages, 4, 0.002, 1.0) == pytest.approx(0.073)  # a core each: slowest stage
    # half a core each: the critical path at a whole core's rate (35 + 1 + 2 ms) or the busy
    # work over the cores (4 of 7 evaluations of 70 ms + 1 ms), whichever is larger
    assert step_time(stages, 4, 0.002, 0.5) == pytest.approx(max(0.038, 0.040 + 0.001))
    # many micro-batches: still never more than the slowest stage at the shared rate
    assert step_time(stages, 64, 0.002, 0.5) == pytest.approx(0.073)
    # one stage, accumulation over m micro-batches (weight m): all work, nothing changes
    single = [_stage(0.070, 0.005, 4.0)]
    assert step_time(single, 4, 0.0, 0.5) == pytest.approx(0.075)


def _fastest(cands: list) -> dict[int, float]:
    out: dict[int, float] = {}
    for c in cands:
        out[c.micro_batches] = min(out.get(c.micro_batches, float("inf")), c.time_s)
    return out


def test_oversubscription_only_changes_pipelines_on_shared_cores() -> None:
    shared, whole = _profile(P2P), _profile(P2P)
    whole = whole.model_copy(update={"device": whole.device.model_copy(update={"core_share": 1.0})})
    # the same per-op costs; only the pipeline's step differs, and only downward
    for dp, tp in ((4, 1), (2, 2)):
        [a], [b] = _on_mesh(shared, 1, dp, tp, pipelined=False), _on_mesh(whole, 1, dp, tp, pipelined=False)
        assert a.time_s == b.time_s
    a = _fastest(_on_mesh(shared, 4, 1, 1))
    b = _fastest(_on_mesh(whole, 4, 1, 1))
    assert a.keys() == b.keys() == {4, 8, 16}
    for m in a:
        assert a[m] < b[m]
    # idle stages hand their core to busy ones: the bubble (pp - 1 of m + pp - 1 slots) costs
    # no CPU, so the fewer the micro-batches, the more the estimate drops
    assert a[4] / b[4] < a[8] / b[8] < a[16] / b[16]
    # gradient accumulation (pp = 1) is all work either way
    acc_a = _fastest(_on_mesh(shared, 1, 4, 1))
    acc_b = _fastest(_on_mesh(whole, 1, 4, 1))
    assert acc_a == pytest.approx(acc_b)


def test_pruned_search_agrees_on_shared_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    prof = _profile(P2P)
    monkeypatch.setattr(search, "PRUNE", False)
    plain = plan_model(prof, 4, None)
    monkeypatch.setattr(search, "PRUNE", True)
    pruned = plan_model(prof, 4, None)
    assert pruned.estimated_step_s == plain.estimated_step_s
    assert pruned.model_dump() == plain.model_dump()
