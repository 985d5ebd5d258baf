"""A plan the user pins in the spec (`parallelism.strategy: pinned`, `mesh`): refused where the
spec is read when the trainer cannot run it, re-pinned by one rule on another device count
(tp and pp stay, dp takes the rest) or refused with the reason, and run as pinned."""

from __future__ import annotations

from pathlib import Path

import pytest
from jobs import assert_losses_match, run, tiny_spec
from parashift.models.plans import pinned_plan_for
from parashift.specs import load_spec
from parashift.specs.plan import Plan

LLAMA = "{family: llama, n_layers: 2, d_model: 64, n_heads: 4, n_kv_heads: 2, ffn_dim: 128, vocab_size: 256, seq_len: 32}"


def spec_file(tmp_path: Path, mesh: str, devices: int = 4, extra: str = "") -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(f"name: pinned\nmodel: {LLAMA}\ntraining: {{global_batch: 8, micro_batch: 2, steps: 4}}\n"
                    f"resources: {{devices: {devices}}}\nparallelism:\n  strategy: pinned\n  mesh: {mesh}\n{extra}")
    return path


@pytest.mark.parametrize(("mesh", "devices", "says"), [
    ("{dp: 2, tp: 4}", 4, r"job.yaml:7:9: parallelism.mesh: its degrees multiply to 8 devices, but resources.devices is 4"),
    ("{dp: 1, tp: 4}", 4, r"job.yaml:7:9: parallelism.mesh: the trainer cannot run it: .*n_kv_heads \(2\) must be "
                          r"divisible by tp \(4\)"),
    ("{pp: 2, dp: 2}", 4, r"job.yaml:7:9: parallelism.mesh: the trainer cannot run it: a pipeline of 2 stages needs "
                          r"at least 2 micro-batches"),
])
def test_a_pinned_plan_the_trainer_cannot_run_is_refused_at_the_field(tmp_path: Path, mesh: str, devices: int,
                                                                      says: str) -> None:
    with pytest.raises(Exception, match=says):
        load_spec(spec_file(tmp_path, mesh, devices))


def test_a_mesh_without_the_pinned_strategy_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(f"name: pinned\nmodel: {LLAMA}\nresources: {{devices: 4}}\nparallelism: {{mesh: {{dp: 4}}}}\n")
    with pytest.raises(Exception, match=r"parallelism.strategy: is 'data-parallel' but a mesh is pinned"):
        load_spec(path)


def test_a_change_of_device_count_re_pins_tp_and_pp_and_gives_dp_the_rest(tmp_path: Path) -> None:
    spec = load_spec(spec_file(tmp_path, "{pp: 2, dp: 1, tp: 2}", extra="  micro_batches: 2\n"))
    plan, refused = pinned_plan_for(spec, 8)
    assert refused is None and plan is not None
    assert plan.mesh == {"pp": 2, "dp": 2, "tp": 2} and plan.dp_shard == 2 and plan.micro_batches == 2
    plan, refused = pinned_plan_for(spec, 6)
    assert plan is None and "6 devices are not a multiple of the pinned tp x pp (2 x 2)" in refused


def test_the_pinned_plan_trains_as_pinned(tmp_path: Path) -> None:
    spec = load_spec(spec_file(tmp_path, "{dp: 2, tp: 2}"))
    spec = spec.model_copy(update={"storage": tiny_spec("x", f"file://{tmp_path / 'store'}").storage,
                                   "data": tiny_spec("x", "file://unused").data})
    plan, _ = pinned_plan_for(spec, 4)
    assert plan is not None and plan.mesh == {"dp": 2, "tp": 2}
    pinned = run(spec, plan)
    reference = run(spec.model_copy(update={"name": "pinned-reference"}), Plan.data_parallel(1))
    assert_losses_match(pinned, [e.loss for e in reference.steps])
