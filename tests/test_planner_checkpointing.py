"""Activation checkpointing and FSDP2 mixed precision in the plan space: chosen only where the
memory limit needs them, exactly as brute force chooses, and priced as the trainer runs them."""

from __future__ import annotations

import pytest
from parashift.planner.builders import gpt_graph
from parashift.planner.checkpointing import checkpointed, with_precision
from parashift.planner.profile import ModelProfile, profile_gpt
from parashift.planner.search import exhaustive_search, plan_model
from parashift.specs.plan import AC_MODES, Plan

from parashift.commands.plan import _bf16_by

ALL = tuple(AC_MODES)


def test_no_limit_no_checkpointing() -> None:
    """Recomputation only adds time: without a memory limit the plan never checkpoints, and its
    time is that of the search without checkpointing."""
    prof = profile_gpt(4, 512, 8, 8192, 256, 16, "cuda")
    plan = plan_model(prof, 4, memory_limit_bytes=None, ac_modes=ALL)
    plain = plan_model(prof, 4, memory_limit_bytes=None)
    assert plan.activation_checkpointing == "none"
    assert plan.estimated_step_s == pytest.approx(plain.estimated_step_s)


def test_a_limit_only_checkpointing_meets_is_met_by_it() -> None:
    """Data parallelism only (no tp, pp or FSDP) and a limit below the least memory of every
    layout without checkpointing: the plan checkpoints, fits, and steps slower than the
    unlimited plan by at most the recomputed forward (a third of forward + backward)."""
    prof = profile_gpt(4, 512, 8, 8192, 512, 16, "cuda")
    only_dp = {"max_tp": 1, "max_pp": 1, "shard_dp": False}
    free = plan_model(prof, 4, memory_limit_bytes=None, **only_dp)
    least = plan_model(prof, 4, memory_limit_bytes=1, **only_dp)  # nothing fits: the least-memory layout
    limit = int(least.memory_per_device_bytes * 0.9)
    plan = plan_model(prof, 4, memory_limit_bytes=limit, ac_modes=ALL, **only_dp)
    assert plan.feasible and plan.memory_per_device_bytes <= limit
    assert plan.activation_checkpointing in ("selective", "full")
    recomputing = plan_model(prof, 4, memory_limit_bytes=None, ac_modes=("full",), **only_dp)
    assert free.estimated_step_s < recomputing.estimated_step_s <= free.estimated_step_s * 4 / 3 * (1 + 1e-9)


@pytest.mark.parametrize("fraction", [1.0, 0.5, 0.0])
def test_the_search_with_checkpointing_agrees_with_brute_force(fraction: float) -> None:
    """The DP over every checkpointing mode returns brute force's plan (time, memory, mode) on a
    small graph, at limits from none needed (the least memory without checkpointing) to full
    checkpointing's least memory."""
    # Two layers of two ops each: brute force enumerates every assignment of every space.
    g = gpt_graph(2, 64, 4, 128, 64, 8).subgraph(["l0.ln1", "l0.qkv", "l1.ln1", "l1.qkv"])
    space = {"max_pp": 1, "max_tp": 2, "device_kind": "cuda", "shard_dp": False}
    least = plan_model(g, 4, 1, **space).memory_per_device_bytes  # nothing fits: the least-memory layout
    least_checkpointed = plan_model(g, 4, 1, ac_modes=("full",), **space).memory_per_device_bytes
    assert least_checkpointed < least
    limit = int(least_checkpointed + (least - least_checkpointed) * fraction)
    a = plan_model(g, 4, limit, ac_modes=ALL, **space)
    b = exhaustive_search(g, 4, limit, ac_modes=ALL, **space)
    assert a.feasible and b.feasible
    assert (a.activation_checkpointing, a.mesh, a.micro_batches) == (b.activation_checkpointing, b.mesh, b.micro_batches)
    assert (a.estimated_step_s, a.memory_per_device_bytes) == pytest.approx((b.estimated_step_s, b.memory_per_device_bytes))
    if fraction < 1.0:
        assert a.activation_checkpointing != "none"


def test_checkpointing_prices_recomputation_and_frees_activations() -> None:
    """Per layer op: full checkpointing keeps only the layer input and recomputes every op;
    selective keeps GEMM outputs and recomputes the rest; ops outside layers are untouched."""
    g = gpt_graph(2, 64, 4, 128, 16, 8)
    full, selective = checkpointed(g, "full"), checkpointed(g, "selective")
    for before, f, s in zip(g.ops, full.ops, selective.ops, strict=True):
        if before.block is None:
            assert f == before and s == before
            continue
        assert f.recompute and f.checkpointed
        assert s.recompute == (before.kind not in ("matmul", "attention"))
    first = [op for op in full.ops if op.block == "layer0"]
    assert [len(op.saved or ()) for op in first] == [1] + [0] * (len(first) - 1)
    assert full.recompute_layers == 2
    assert checkpointed(g, "none") is g


def test_fsdp_mixed_precision_gathers_bf16_and_keeps_no_autocast_copies() -> None:
    g = gpt_graph(2, 64, 4, 128, 16, 8, precision="bf16")
    assert g.weight_cast_bytes == 2
    fsdp, autocast = with_precision(g, "fsdp"), with_precision(g, "autocast")
    assert (fsdp.weight_cast_bytes, fsdp.gather_bytes) == (0, 2)
    assert (autocast.weight_cast_bytes, autocast.gather_bytes) == (2, 4)
    prof = profile_gpt(4, 1024, 8, 8192, 256, 16, "cuda")
    by = {mp: plan_model(prof, 8, None, max_tp=1, max_pp=1, mixed_precision=mp) for mp in ("autocast", "fsdp")}
    assert by["fsdp"].baseline_memory_bytes["fsdp"] < by["autocast"].baseline_memory_bytes["fsdp"]


def test_pipeline_stages_take_their_own_checkpointing_where_only_the_first_is_short() -> None:
    """Under 1F1B the first stage holds the most micro-batches: at a limit only it strains, the
    planner checkpoints that stage alone (after its search, the per-op layout kept), never
    slower than one mode for every stage, and still within the limit by the estimate of each
    stage as it runs (planner.pinned)."""
    from parashift.models import family_of
    from parashift.planner.pinned import estimate
    from parashift.planner.profile import profile_graph
    from parashift.specs import JobSpec

    model = {"family": "llama", "n_layers": 8, "d_model": 2048, "n_heads": 16, "n_kv_heads": 8, "ffn_dim": 5632,
             "vocab_size": 32000, "seq_len": 2048}
    m = JobSpec.model_validate({"name": "x", "model": model, "training": {"global_batch": 16}}).model
    profile = profile_graph(family_of(m).graph(m, 16, "fp32"), "cuda")
    limit = 6 * 2**30
    plan = plan_model(profile, 2, limit, max_tp=1, ac_modes=AC_MODES, shard_dp=False)
    assert plan.mesh == {"pp": 2} and plan.stage_activation_checkpointing == ["selective", "none"], plan
    assert plan.proven_optimal is None and any("per pipeline stage" in note for note in plan.notes)
    uniform = plan_model(profile, 2, limit, max_tp=1, ac_modes=("selective",), shard_dp=False)
    assert plan.estimated_step_s <= uniform.estimated_step_s
    for stage in (0, 1):
        assert estimate(profile, plan, stage=stage).memory_bytes <= limit


def _llama_profile(batch: int) -> ModelProfile:
    """A small Llama's graph in bf16 on H200s (the planner's defaults), for `batch` sequences."""
    from parashift.models import family_of
    from parashift.planner.profile import profile_graph
    from parashift.specs import JobSpec

    model = {"family": "llama", "n_layers": 4, "d_model": 1024, "n_heads": 16, "n_kv_heads": 4, "ffn_dim": 2816,
             "vocab_size": 32000, "seq_len": 1024}
    m = JobSpec.model_validate({"name": "x", "model": model, "training": {"global_batch": batch, "micro_batch": 1},
                             "resources": {"devices": 1}}).model
    return profile_graph(family_of(m).graph(m, batch, "bf16"), "cuda")


@pytest.mark.parametrize("fraction", [None, 0.6])
def test_fsdp_mixed_precision_without_a_data_axis_is_priced_as_the_autocast_that_runs(fraction: float | None) -> None:
    """FSDP2's policy needs a data axis to hold it (trainer.parallel.fsdp_mixed_precision): a plan
    without one computes under autocast. With one sequence per step no plan has a data axis, so
    a job pinning 'fsdp' is searched and estimated exactly as one pinning 'autocast', at every
    limit: the plan is never one that fits only on paper (bf16 parameters it will not have)."""
    from parashift.planner.pinned import estimate

    profile = _llama_profile(1)
    least = plan_model(profile, 4, 1, mixed_precision="autocast").memory_per_device_bytes  # nothing fits: least memory
    free = plan_model(profile, 4, None, mixed_precision="autocast").memory_per_device_bytes
    limit = None if fraction is None else int(least + (free - least) * fraction)
    by = {mp: plan_model(profile, 4, limit, ac_modes=ALL, mixed_precision=mp) for mp in ("autocast", "fsdp")}
    a, f = by["autocast"], by["fsdp"]
    assert "dp" not in a.mesh and a.feasible
    assert (f.mesh, f.micro_batches, f.activation_checkpointing, f.stage_activation_checkpointing) == (
        a.mesh, a.micro_batches, a.activation_checkpointing, a.stage_activation_checkpointing)
    assert (f.estimated_step_s, f.memory_per_device_bytes) == pytest.approx((a.estimated_step_s, a.memory_per_device_bytes))
    assert f.baselines == pytest.approx(a.baselines)
    for stage in range(a.degree("pp")):
        fsdp, autocast = estimate(profile, a, "fsdp", stage=stage), estimate(profile, a, "autocast", stage=stage)
        assert (fsdp.time_s, fsdp.memory_bytes) == pytest.approx((autocast.time_s, autocast.memory_bytes))
    # and `parashift plan` says which policy the plan runs
    assert _bf16_by("fsdp", f) == "autocast (FSDP2's policy needs a data axis, and this plan has none)"
    assert (_bf16_by("fsdp", Plan.data_parallel(2)), _bf16_by("autocast", f)) == ("fsdp", "autocast")


def test_fsdp_mixed_precision_is_never_slower_and_gains_only_with_a_data_axis() -> None:
    """FSDP2's policy gathers and keeps bf16 where autocast keeps fp32 weights and bf16 copies:
    on every mesh with a data axis it costs no more on any term, so at every limit the search
    under it is at least as fast; where its pick is faster, the pick has a data axis."""
    profile = _llama_profile(4)
    least = plan_model(profile, 4, 1, ac_modes=ALL, mixed_precision="fsdp").memory_per_device_bytes
    free = plan_model(profile, 4, None, mixed_precision="autocast").memory_per_device_bytes
    for fraction in (0.5, 0.2):  # the first picks a data axis under FSDP2's policy, the second none
        limit = int(least + (free - least) * fraction)
        a = plan_model(profile, 4, limit, ac_modes=ALL, mixed_precision="autocast")
        f = plan_model(profile, 4, limit, ac_modes=ALL, mixed_precision="fsdp")
        assert f.feasible and f.memory_per_device_bytes <= limit
        if a.feasible:
            assert f.estimated_step_s <= a.estimated_step_s * (1 + 1e-9), (fraction, f.mesh, a.mesh)
            if f.estimated_step_s < a.estimated_step_s * (1 - 1e-9):
                assert f.degree("dp") > 1, (fraction, f.mesh)
