"""Re-planning counts the move: the next plan is the one that finishes the remaining steps
first, estimated step time x steps + the checkpoint's bytes to read over the store's rate."""

from __future__ import annotations

from pathlib import Path

import pytest
from jobs import run, tiny_spec
from parashift.models.plans import job_plan_refusals
from parashift.planner.profile import profile_gpt
from parashift.planner.replan import Option, pick
from parashift.planner.search import plan_options
from parashift.specs.plan import Plan
from parashift.tasks.plan import cheapest_to_continue

MODEL = {"n_layers": 2, "d_model": 48, "n_heads": 4, "vocab_size": 256, "seq_len": 24, "dropout": 0.0}


def test_few_remaining_steps_favour_the_cheaper_move() -> None:
    fast, cheap = Plan.data_parallel(2, estimated_step_s=1.0), Plan(devices=2, mesh={"tp": 2}, strategy="x", estimated_step_s=1.1)
    options = [Option(fast, 1.0, move_bytes=8_000_000_000), Option(cheap, 1.1, move_bytes=4_000_000_000)]
    assert pick(options, remaining_steps=10, read_bytes_per_s=1e9).plan is cheap  # 10 + 8 > 11 + 4
    assert pick(options, remaining_steps=1000, read_bytes_per_s=1e9).plan is fast
    with pytest.raises(ValueError):
        pick([], 1, 1e9)


def test_a_resumed_job_picks_a_different_plan_than_step_time_alone(tmp_path: Path) -> None:
    """From a real checkpoint: data parallelism steps faster on CPU workers (the cost model's
    estimate), but every rank must read the whole state; tensor parallelism reads half per rank.
    Near the end of the job the move decides; far from it the step time does."""
    spec = tiny_spec("replan", f"file://{tmp_path}/store", model=MODEL, training={"steps": 2},
                     parallelism={"strategy": "auto"})
    result = run(spec, Plan.data_parallel(2))  # a checkpoint to move (on the session's warm workers)
    assert result.final_step == 2
    profile = profile_gpt(2, 48, 4, 256, 24, 8, device_kind="cpu")
    options = [p for p in plan_options(profile, 2, device_kind="cpu", shard_dp=False) if not job_plan_refusals(p, spec)]
    assert {str(p.mesh) for p in options} >= {str({"dp": 2}), str({"tp": 2})}, [p.mesh for p in options]
    fastest = min(options, key=lambda p: p.estimated_step_s)
    slow_store = 1e6  # bytes/s: a move of ~1 MB costs about a second

    near_end = spec.model_copy(update={"training": spec.training.model_copy(update={"steps": 3})})
    chosen, rows = cheapest_to_continue(near_end, options, step=2, read_bytes_per_s=slow_store)
    least_moved = min(rows, key=lambda r: r["move_mb"])
    assert str(chosen.plan.mesh) == least_moved["mesh"] != str(fastest.mesh)
    assert [r["chosen"] for r in rows].count(True) == 1

    far_from_end = spec.model_copy(update={"training": spec.training.model_copy(update={"steps": 10_000_000})})
    chosen, _ = cheapest_to_continue(far_from_end, options, step=2, read_bytes_per_s=slow_store)
    assert chosen.plan.mesh == fastest.mesh


def test_the_options_of_a_resumed_job_reuse_the_search_already_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """A resumed job's plan choice weighs the search's pick against the baselines: given the
    pick, `plan_options` does not search again (it ran twice on every resumed segment)."""
    import parashift.planner.search

    profile = profile_gpt(2, 48, 4, 256, 24, 8, device_kind="cpu")
    searched = parashift.planner.search.plan_model(profile, 2, device_kind="cpu", shard_dp=False)
    fresh = plan_options(profile, 2, device_kind="cpu", shard_dp=False)

    def no_second_search(*args: object, **kwargs: object) -> Plan:
        raise AssertionError("the search ran again")

    monkeypatch.setattr(parashift.planner.search, "plan_model", no_second_search)
    reused = plan_options(profile, 2, device_kind="cpu", shard_dp=False, searched=searched)
    assert [p.model_dump() for p in reused] == [p.model_dump() for p in fresh]


def test_a_new_device_count_reuses_the_measured_collectives(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Re-planning onto another device count measures no collectives again: the comm model
    fitted on the first count (latency and bandwidth per link) is the profile's for any."""
    import parashift.launcher.launch
    from parashift.planner.comm import CommModel, Link
    from parashift.tasks.profile import build_profile

    def measuring(*args: object) -> None:
        raise AssertionError("collectives measured again")

    monkeypatch.setattr(parashift.launcher.launch, "measure_comm_timings", measuring)
    spec = tiny_spec("reuse", f"file://{tmp_path}/store", resources={"devices": 3, "kind": "cpu"},
                     parallelism={"strategy": "auto"})
    link = Link(latency_s=1e-4, bandwidth_Bps=1e9)
    measured = CommModel(intra=link, inter=link, measured=True)
    profile = build_profile(spec, measured)
    assert profile.comm == measured and profile.device.core_share < 1  # 3 workers on this machine's cores


def test_coming_back_to_a_device_count_does_not_search_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """4 -> 2 -> 4: the second search for 4 devices is the first one's result (the search is
    deterministic); another profile, batch or limit searches afresh."""
    from parashift.tasks import plan as plan_task

    spec = tiny_spec("memo", f"file://{tmp_path}/store", model=MODEL)
    profile = profile_gpt(2, 48, 4, 256, 24, 8, device_kind="cpu")
    searches: list[int] = []
    real = plan_task.plan_model

    def counted(source, devices, *args, **kwargs):  # noqa: ANN001, ANN202 - plan_model's own
        searches.append(devices)
        return real(source, devices, *args, **kwargs)

    monkeypatch.setattr(plan_task, "plan_model", counted)
    monkeypatch.setattr(plan_task, "_SEARCHED", {})
    first = plan_task._search(spec, profile, 4, None)
    plan_task._search(spec, profile, 2, None)
    again = plan_task._search(spec, profile, 4, None)
    assert searches == [4, 2] and again == first and again is not first
    plan_task._search(spec, profile, 4, 10**9)
    other = profile_gpt(2, 48, 4, 256, 24, 16, device_kind="cpu")
    plan_task._search(spec, other, 4, None)
    assert searches == [4, 2, 4, 4]


def test_a_plan_made_ahead_is_the_plan_made_at_the_change(tmp_path: Path) -> None:
    """PlansAhead searches while the job trains, before the checkpoint it will move exists; the
    plan taken at the change is the one planning then would make: the move of the newest
    checkpoint is weighed when it is taken. A count not asked for is planned as usual (None)."""
    from parashift.planner.comm import CommModel, Link
    from parashift.storage import JobPaths, open_store
    from parashift.tasks.plan import PlansAhead, finish_plan, prepare_plan
    from parashift.tasks.profile import build_profile, ensure_profile, profile_key

    spec = tiny_spec("ahead", f"file://{tmp_path}/store", model=MODEL, training={"steps": 2},
                     parallelism={"strategy": "auto"})
    link = Link(latency_s=1e-4, bandwidth_Bps=1e9)  # as if measured on the job's workers (no launch here)
    profile = build_profile(spec, CommModel(intra=link, inter=link, measured=True))
    open_store(spec.storage).put_json(JobPaths("ahead").profile(profile_key(spec)), profile.model_dump(mode="json"))
    first = ensure_profile(spec)
    ahead = PlansAhead(spec, first)
    try:
        ahead.prepare([2, 1])
        assert ahead.take(2) is not None and ahead.take(1) is not None  # made before anything is committed
        assert ahead.take(3, wait_s=0.1) is None
        assert run(spec, Plan.data_parallel(2)).final_step == 2  # now a checkpoint to move
        near_end = spec.model_copy(update={"training": spec.training.model_copy(update={"steps": 3})})
        slow_store = 1e6
        taken, choice = finish_plan(near_end, ahead.take(2), 2, slow_store)
        now, choice_now = finish_plan(near_end, prepare_plan(near_end, first, 2), 2, slow_store)
        # a count other than the spec's, as the flow plans it when nothing was made ahead
        one_profile = ensure_profile(spec.on_devices(1), rates_from=first.profile_key)
        one_ahead, _ = finish_plan(near_end, ahead.take(1), 2, slow_store)
        one_now, _ = finish_plan(near_end, prepare_plan(near_end, one_profile, 1), 2, slow_store)
    finally:
        ahead.close()
    assert taken.model_dump() == now.model_dump() and choice == choice_now
    assert one_ahead.devices == 1 and one_ahead.model_dump() == one_now.model_dump()
    assert choice is not None and str(taken.mesh) == min(choice, key=lambda r: r["move_mb"])["mesh"]


def test_another_device_count_reuses_the_jobs_measured_rates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A count planned ahead (while the job trains) or at a change takes the device rates the
    job's first profile measured, at its own share of the cores: it times no GEMM on cores the
    workers are using. Equal to a profile measured fresh for that count, up to the timing."""
    from parashift.planner import profile as planner_profile
    from parashift.planner.comm import CommModel, Link
    from parashift.planner.profile import DeviceModel, share_cores
    from parashift.storage import JobPaths, open_store
    from parashift.tasks.profile import build_profile, ensure_profile, load_profile, profile_key

    spec = tiny_spec("rates", f"file://{tmp_path}/store", model=MODEL, resources={"devices": 4},
                     parallelism={"strategy": "auto"})
    link = Link(latency_s=1e-4, bandwidth_Bps=1e9)
    timed = DeviceModel(kind="cpu", matmul_flops=4e10, memory_Bps=8e9, measured=True)
    monkeypatch.setattr(planner_profile, "measure_device", lambda kind="cpu", repeats=3: timed.model_copy())
    profile = build_profile(spec, CommModel(intra=link, inter=link, measured=True))
    open_store(spec.storage).put_json(JobPaths("rates").profile(profile_key(spec)), profile.model_dump(mode="json"))
    first = ensure_profile(spec)

    def no_timing(kind: str = "cpu", repeats: int = 3) -> DeviceModel:
        raise AssertionError("timed GEMMs again for another count of the same job")

    monkeypatch.setattr(planner_profile, "measure_device", no_timing)
    said: list[str] = []
    for devices in (1, 2, 3):
        other = spec.on_devices(devices)
        reused = load_profile(other, ensure_profile(other, rates_from=first.profile_key, say=said.append).profile_key)
        fresh = build_profile(other, profile.comm, timed.model_copy())  # as measuring here would make it
        assert reused.device == fresh.device == share_cores(timed, devices)
        assert reused.comm == profile.comm
    assert profile.device == share_cores(timed, 4)
    assert sum("measured for another device count of the job" in line for line in said) == 3, said
