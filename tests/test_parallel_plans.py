"""Every kind of Plan on real gloo workers (1-4 processes) against one single-process reference:
the loss at each of the first 10 of its 20 steps within 1e-5 relative, and the parameters and
optimizer state there (full tensors assembled from the checkpoint) equal up to fp32 rounding.
Also: a checkpoint saved under one plan resumes under others, and plans the trainer cannot run
are refused before any process starts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from jobs import (
    assert_bitwise_equal,
    assert_losses_match,
    assert_state_matches,
    final_state,
    mesh_plan,
    run,
    tiny_spec,
)
from parashift.launcher.launch import launch_workers
from parashift.planner.profile import profile_gpt
from parashift.planner.search import plan_model
from parashift.specs import JobSpec
from parashift.specs.plan import Plan, TensorParallel, plan_refusals

pytestmark = pytest.mark.slow

# 2 layers, d 48, 4 heads, T 24 (divisible by tp 1-4), vocab 256, global batch 8.
MODEL = {"n_layers": 2, "d_model": 48, "n_heads": 4, "vocab_size": 256, "seq_len": 24, "dropout": 0.0}
TRAINING = {"global_batch": 8, "micro_batch": 4, "steps": 20, "seed": 7, "checkpoint_every": 10}
# Each plan trains the job's first half (its schedule as the reference's: the same spec,
# stopped there): 10 steps of 4 processes on 2 cores are most of this file's time.
HALF = 10


def spec_for(name: str, tmp: Path) -> JobSpec:
    return tiny_spec(name, f"file://{tmp}/store", model=MODEL, training=TRAINING)


def planner_plan(devices: int, max_tp: int | None, max_pp: int | None) -> Plan:
    """What the planner emits for this model on `devices` CPU workers under the plain CPU
    roofline: no fitted dispatch overheads, no gradient bucketing. The calibrated model (rightly)
    avoids tensor parallelism on 2 cores; these tests need the planner's mixed per-op plans."""
    profile = profile_gpt(2, 48, 4, 256, 24, 8, device_kind="cpu")
    roofline = profile.device.model_copy(update={"op_overhead_s": 0.0, "sharded_op_overhead_s": 0.0})
    unbucketed = profile.comm.model_copy(update={"gradient_bucket_bytes": 1})
    profile = profile.model_copy(update={"device": roofline, "comm": unbucketed})
    return plan_model(profile, devices, max_tp=max_tp, max_pp=max_pp, device_kind="cpu", shard_dp=False)


LAYERS = tuple(range(MODEL["n_layers"]))


def attention_only_tp(mesh: dict[str, int]) -> Plan:
    """A mixed plan: Megatron attention and sequence parallel norms, but replicated MLPs and a
    replicated embedding and head."""
    return mesh_plan(mesh, tensor_parallel=TensorParallel(sequence=True, attention=LAYERS))


def megatron_replicated_stream(mesh: dict[str, int]) -> Plan:
    """Megatron attention and MLP, everything else replicated over tp (no sequence parallelism):
    the region boundaries are the in-place all-reduces of trainer/tp_styles.py's fast path."""
    return mesh_plan(mesh, tensor_parallel=TensorParallel(attention=LAYERS, mlp=LAYERS))


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[float], dict[str, torch.Tensor],
                                                              dict[str, torch.Tensor]]:
    """One process, no parallelism: the losses, the final state and the state at step HALF
    every plan must reproduce."""
    spec = spec_for("reference", tmp_path_factory.mktemp("reference"))
    result = run(spec, Plan.data_parallel(1))
    losses = [e.loss for e in result.steps]
    assert len(losses) == 20 and losses[-1] < losses[0] - 0.3
    return losses, final_state(spec), final_state(spec, step=HALF)


PLANS = {
    "dp4": lambda: Plan.data_parallel(4),
    "tp4": lambda: mesh_plan({"tp": 4}),  # no placements: Megatron + sequence + loss parallel
    "dp2xtp2": lambda: mesh_plan({"dp": 2, "tp": 2}),
    "pp2xdp2-planner-1f1b": lambda: planner_plan(4, max_tp=1, max_pp=2),
    "pp2xtp2-gpipe": lambda: mesh_plan({"pp": 2, "tp": 2}, micro_batches=4),
    "dp3": lambda: Plan.data_parallel(3),  # shares of 3, 3 and 2 samples
    "tp3-planner-mixed": lambda: planner_plan(3, max_tp=None, max_pp=1),
    "tp4-planner-mixed": lambda: planner_plan(4, max_tp=None, max_pp=1),
    "dp2xtp2-attention-only": lambda: attention_only_tp({"dp": 2, "tp": 2}),
    "tp4-megatron-replicated-stream": lambda: megatron_replicated_stream({"tp": 4}),
    # The dp axis sharding the training state (FSDP2), alone and with every other axis.
    "fsdp4": lambda: Plan.fully_sharded(4),
    "fsdp3": lambda: Plan.fully_sharded(3),  # uneven shards of every tensor, shares of 3, 3, 2
    "fsdp2xtp2": lambda: mesh_plan({"dp": 2, "tp": 2}, dp_shard=2),
    "hsdp2x2": lambda: mesh_plan({"dp": 4}, dp_shard=2),
    "pp2xfsdp2": lambda: mesh_plan({"pp": 2, "dp": 2}, dp_shard=2, micro_batches=2),
    # FSDP keeping the gathered weights through the step (the planner's other sharded choice)
    "pp2xfsdp2-held": lambda: mesh_plan({"pp": 2, "dp": 2}, dp_shard=2, micro_batches=4, reshard_after_forward=False),
}


@pytest.mark.parametrize("name", list(PLANS))
def test_plan_matches_single_process(name: str, reference, tmp_path: Path) -> None:
    expected_losses, _, expected_state = reference
    plan = PLANS[name]()
    result = run(spec_for(name, tmp_path), plan, until_step=HALF, schedule="GPipe" if "gpipe" in name else None)
    assert result.final_step == HALF
    assert_losses_match(result, expected_losses)
    assert_state_matches(final_state(spec_for(name, tmp_path)), expected_state)


def test_planner_plans_are_the_mixed_ones_tested() -> None:
    """The planner's choices for this model really are mixed per-op plans (else the two
    planner cases above would test nothing new)."""
    tp4 = planner_plan(4, None, 1).tensor_parallel
    assert tp4 is not None and tp4.mlp and not tp4.attention, tp4
    tp3 = planner_plan(3, None, 1)
    assert tp3.mesh == {"tp": 3} and tp3.tensor_parallel is not None and not tp3.trainer_refusals
    pp = planner_plan(4, max_tp=1, max_pp=2)
    assert pp.degree("pp") == 2 and pp.stage_layers


def test_checkpoint_moves_between_plans(reference, tmp_path: Path) -> None:
    """Saved under dp2 x tp2, resumed under tp4, then under pp2 x dp2: the same losses and the
    same final state as the uninterrupted single process."""
    expected_losses, expected_state, _ = reference
    spec = spec_for("moving", tmp_path)
    run(spec, mesh_plan({"dp": 2, "tp": 2}), until_step=7)
    second = run(spec, mesh_plan({"tp": 4}), until_step=14)
    assert second.start is not None and second.start.resumed and second.start.step == 7
    assert_losses_match(second, expected_losses)
    third = run(spec, mesh_plan({"pp": 2, "dp": 2}, micro_batches=2))
    assert third.start is not None and third.start.step == 14
    assert third.final_step == 20
    assert_losses_match(third, expected_losses)
    assert_state_matches(final_state(spec), expected_state)


def test_checkpoint_moves_between_sharded_plans(reference, tmp_path: Path) -> None:
    """Replicated -> sharded -> sharded with tp -> pipelined and sharded -> HSDP -> tensor
    parallel -> pipelined and replicated: every three steps a new plan resumes the last one's
    checkpoint, and the run keeps the losses and the final state of the uninterrupted single
    process."""
    expected_losses, expected_state, _ = reference
    spec = spec_for("sharded-moves", tmp_path)
    plans = [mesh_plan({"dp": 2, "tp": 2}), Plan.fully_sharded(4), mesh_plan({"dp": 2, "tp": 2}, dp_shard=2),
             mesh_plan({"pp": 2, "dp": 2}, dp_shard=2, micro_batches=2), mesh_plan({"dp": 4}, dp_shard=2),
             mesh_plan({"tp": 4}), mesh_plan({"pp": 2, "dp": 2}, micro_batches=2)]
    for i, plan in enumerate(plans):
        until = min(3 * (i + 1), 20) if i < len(plans) - 1 else None
        result = run(spec, plan, until_step=until)
        assert result.start is not None and result.start.step == 3 * i
        assert result.final_step == (until or 20)
        assert_losses_match(result, expected_losses)
    assert_state_matches(final_state(spec), expected_state)


def test_tp4_tp3_tp1_chain_three_times(reference, tmp_path: Path) -> None:
    """Tensor-parallel degree changes 4 -> 3 -> 1, three times over (every two steps, the last
    tp1 to the end): the losses of the uninterrupted single process at every step, and its final
    state. tp3 is the planner's mixed plan (4 heads do not split 3 ways: MLPs, embedding and
    head shard), so uneven boxes move too."""
    expected_losses, expected_state, _ = reference
    spec = spec_for("chain", tmp_path)
    plans = [mesh_plan({"tp": 4}), planner_plan(3, max_tp=None, max_pp=1), Plan.data_parallel(1)] * 3
    for i, plan in enumerate(plans):
        last = i == len(plans) - 1  # the last tp1 segment trains to the end
        result = run(spec, plan, until_step=None if last else 2 * (i + 1))
        assert result.start is not None and result.start.step == 2 * i
        assert result.final_step == (20 if last else 2 * (i + 1))
        if i:
            restoring = result.restoring
            assert restoring is not None and restoring.bytes_read == restoring.bytes_needed  # rank 0 reads exactly its bytes
        assert_losses_match(result, expected_losses)
    assert_state_matches(final_state(spec), expected_state)


def test_unexecutable_plans_are_refused_with_reasons() -> None:
    sizes = {"n_layers": 2, "n_heads": 4, "seq_len": 24, "global_batch": 8}
    tp3 = plan_refusals(mesh_plan({"tp": 3}), **sizes)
    assert any("n_heads (4) divisible by tp (3)" in r for r in tp3), tp3
    sp = plan_refusals(mesh_plan({"tp": 4}), **{**sizes, "seq_len": 30})
    assert any("seq_len (30)" in r for r in sp), sp
    beyond = plan_refusals(mesh_plan({"tp": 2}, tensor_parallel=TensorParallel(mlp=(0, 2))), **sizes)
    assert any("layers [2] do not exist" in r for r in beyond), beyond
    pp = plan_refusals(mesh_plan({"pp": 2, "dp": 2}, micro_batches=3), **sizes)
    assert any("micro-batches" in r for r in pp), pp
    assert plan_refusals(mesh_plan({"pp": 2, "tp": 2}, micro_batches=4), **sizes) == []
    too_few = plan_refusals(mesh_plan({"pp": 2, "tp": 2}, micro_batches=1), **sizes)
    assert any("at least 2 micro-batches" in r for r in too_few), too_few
    assert mesh_plan({"tp": 2}).tp_regions(2) == TensorParallel.megatron(2)
    assert plan_refusals(mesh_plan({"pp": 2, "dp": 2}, dp_shard=2, micro_batches=2), **sizes) == []


def test_launcher_refuses_an_unexecutable_plan_before_starting_processes(tmp_path: Path) -> None:
    from parashift.launcher.launch import PlanNotExecutable

    spec = tiny_spec("refused", f"file://{tmp_path}/store", model={"n_heads": 2})
    with pytest.raises(PlanNotExecutable, match=r"n_heads \(2\) divisible by tp \(3\)"):
        launch_workers(spec, mesh_plan({"tp": 3}))
    assert not (tmp_path / "store").exists()


def test_dropout_under_tensor_parallelism_resumes_bitwise(tmp_path: Path) -> None:
    """With dropout, tp peers must draw the same masks where activations are replicated over tp:
    else their replicated parameters drift apart, a checkpoint keeps one copy, and a resumed
    run leaves the path of an uninterrupted one (it did, before the fix: 171 apart)."""
    plan = megatron_replicated_stream({"tp": 2})
    model = {**MODEL, "dropout": 0.2}
    whole = tiny_spec("dropout-whole", f"file://{tmp_path}/whole", model=model, training=TRAINING)
    run(whole, plan)
    parts = tiny_spec("dropout-parts", f"file://{tmp_path}/parts", model=model, training=TRAINING)
    assert run(parts, plan, until_step=7).final_step == 7
    assert run(parts, plan).final_step == TRAINING["steps"]
    assert_bitwise_equal(final_state(parts), final_state(whole))


def test_a_global_batch_smaller_than_the_devices_trains_on_a_pinned_mesh_exactly(tmp_path: Path) -> None:
    """Two sequences a step on four devices: a spec refused any device count above its global
    batch, though tensor parallelism takes what a data axis cannot (a fine-tune's small batch on
    a node). A pinned dp 2 x tp 2 now loads and gives the single process's losses; a pinned data
    axis wider than the batch is still refused, at the mesh."""
    from parashift.specs import SpecError, load_spec

    small = {**TRAINING, "global_batch": 2, "micro_batch": 1, "steps": 3}
    text = (f"name: small\nmodel: {MODEL}\ntraining: {small}\nresources: {{devices: 4}}\n"
            f"parallelism: {{strategy: pinned, mesh: {{dp: 2, tp: 2}}}}\nstorage: {{url: 'file://{tmp_path}/store'}}\n")
    (tmp_path / "small.yaml").write_text(text)
    spec = load_spec(tmp_path / "small.yaml")
    (tmp_path / "wide.yaml").write_text(text.replace("{dp: 2, tp: 2}", "{dp: 4}"))
    with pytest.raises(SpecError, match="parallelism.mesh: the trainer cannot run it: global batch 2 is smaller"):
        load_spec(tmp_path / "wide.yaml")
    one = JobSpec.model_validate({**spec.model_dump(), "name": "small-one", "resources": {"devices": 1},
                                  "parallelism": {}})
    expected = [e.loss for e in run(one, Plan.data_parallel(1)).steps]
    assert_losses_match(run(spec, spec.parallelism.pinned(4)), expected)
