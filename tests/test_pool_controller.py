"""The pool controller's bookkeeping without Prefect (pool.controller, pool.state): what it starts,
tells and stops for recorded observations, and its state in storage refusing what is corrupt."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from parashift.pool.allocator import PoolPolicy
from parashift.pool.controller import RESEND_S, PoolBook, Preempt, Resize, Start
from parashift.pool.state import (
    PoolState,
    PoolStateCorrupt,
    pool_key,
    read_state,
    submissions,
    submit,
    write_state,
)
from parashift.pool.step_times import Measured, Prediction, blended, counts_for
from parashift.specs import JobSpec, SpecError
from parashift.specs.models import StorageSpec
from parashift.specs.pool import load_pool
from parashift.storage import open_store

LINEAR = {1: 1.0, 2: 0.5, 3: 0.34, 4: 0.26}


def job(name: str, steps: int = 1000, **resources: object) -> JobSpec:
    return JobSpec.model_validate({"name": name, "training": {"steps": steps, "global_batch": 16},
                                   "resources": resources})


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def book_of(devices: int = 4) -> tuple[PoolBook, Clock]:
    clock = Clock()
    return PoolBook(PoolState(pool="p", devices=devices), PoolPolicy(horizon_s=600.0), clock), clock


def test_a_pool_file_error_names_file_line_and_field(tmp_path: Path) -> None:
    path = tmp_path / "pool.yaml"
    path.write_text("name: p\ndevices: 0\npolicy: {horizon: 5}\n")
    with pytest.raises(SpecError) as error:
        load_pool(path)
    lines = error.value.lines()
    assert lines[0].startswith(f"{path}:2:10: devices: must be greater than or equal to 1"), lines
    assert lines[1].startswith(f"{path}:3:10: policy.horizon: unknown key 'horizon'; did you mean 'horizon_s'?"), lines


def test_a_pool_over_nodes_has_its_nodes_devices_and_says_what_does_not_add_up(tmp_path: Path) -> None:
    path = tmp_path / "pool.yaml"
    path.write_text("name: p\nnodes: [gpu-a, gpu-b]\ndevices_per_node: 8\n")
    assert load_pool(path).devices == 16
    path.write_text("name: p\nnodes: [gpu-a, gpu-b]\ndevices_per_node: 8\ndevices: 12\n")
    with pytest.raises(SpecError) as error:
        load_pool(path)
    assert error.value.lines()[0].startswith(f"{path}:4:10: devices: must be nodes x devices_per_node = 2 x 8 = 16")
    path.write_text("name: p\nnodes: [gpu-a]\n")
    with pytest.raises(SpecError, match="devices_per_node: a pool over nodes names the devices of each node"):
        load_pool(path)


def test_state_round_trips_and_a_corrupted_state_is_refused(tmp_path: Path) -> None:
    store = open_store(StorageSpec(url=f"file://{tmp_path}"))
    book, _ = book_of()
    book.submitted("k", 1.0, job("a"), lambda spec: Prediction(LINEAR))
    write_state(store, book.state)
    assert read_state(store, "p", 4) == book.state
    path = tmp_path / pool_key("p", "state.json")
    raw = path.read_bytes()
    assert raw.count(b'"submitted_at": 1.0') == 1
    path.write_bytes(raw.replace(b'"submitted_at": 1.0', b'"submitted_at": 2.0'))  # valid JSON, wrong bytes
    with pytest.raises(PoolStateCorrupt, match="fails its sha256 digest"):
        read_state(store, "p", 4)


def test_submissions_are_taken_once_and_a_bad_one_is_refused_with_why(tmp_path: Path) -> None:
    store = open_store(StorageSpec(url=f"file://{tmp_path}"))
    first = submit(store, "p", job("a"), now=1.0)
    store.put(pool_key("p", "submitted", "0000000005000-b.json"), b"{not json")
    book, _ = book_of()
    found = submissions(store, "p", set())
    events = [book.submitted(key, at, spec, lambda spec: Prediction(LINEAR)) for key, at, spec in found]
    assert events[0] == "a submitted" and events[1].startswith("refused a submission:"), events
    assert book.state.jobs["a"].spec.resources.pool == "p"  # a pool job holds the pool's devices
    assert submissions(store, "p", set(book.state.submissions_seen)) == []
    submit(store, "p", job("a"), now=3.0)
    again = submissions(store, "p", set(book.state.submissions_seen))
    assert first not in [key for key, _, _ in again]
    assert book.submitted(*again[0], lambda spec: Prediction(LINEAR)) == "refused a: it is already in the pool (waiting)"


def test_a_job_with_scripted_elasticity_is_refused_by_any_pool(tmp_path: Path) -> None:
    """The pool sets its jobs' device counts: a spec's own `elasticity` would change its count
    against the pool's share (and take device slots the pool gave others). Refused by the
    controller (every way of submitting) and by `parashift submit`, naming the field."""
    scripted = JobSpec.model_validate({"name": "scripted", "training": {"steps": 100, "global_batch": 16},
                                       "elasticity": [{"at_step": 50, "devices": 3}]})
    book, _ = book_of()
    assert book.submitted("k", 1.0, scripted, lambda spec: Prediction(LINEAR)) == (
        "refused scripted: elasticity: a pool sets its jobs' device counts; leave it out")
    assert "scripted" not in book.state.jobs
    spec, out = submitted(tmp_path, "devices: 4",
                          "name: scripted\ntraining: {steps: 100}\nelasticity:\n  - {at_step: 50, devices: 3}\n")
    assert out.exit_code == 1 and f"{spec}: elasticity: a pool sets its jobs' device counts" in out.output, out.output


def test_a_running_job_is_told_its_devices_only_once_it_steps_and_again_if_unheard() -> None:
    book, clock = book_of()
    book.submitted("k1", 1.0, job("a"), lambda spec: Prediction(LINEAR))
    book.allocate(["a submitted"])
    (start,) = book.actions({})
    assert isinstance(start, Start) and start.spec.resources.devices == 4
    book.state.jobs["a"].flow_run_id = "run-a"
    clock.now += 5
    book.submitted("k2", 2.0, job("b"), lambda spec: Prediction(LINEAR))
    book.allocate(["b submitted"])
    assert book.state.jobs["a"].devices + book.state.jobs["b"].devices == 4 and book.state.jobs["b"].devices
    actions = book.actions({})  # a has logged no step yet: not told (its subscription may not be up)
    assert [type(a) for a in actions] == [Start]
    book.state.jobs["b"].flow_run_id = "run-b"
    stepping = {"a": Measured(step_s={4: 0.26}, last_step=3, devices_now=4)}
    (resize,) = book.actions(stepping)
    assert resize == Resize("a", book.state.jobs["a"].devices, 4)
    assert book.actions(stepping) == []  # told; still on 4 a moment later: not told again yet
    clock.now += RESEND_S + 1
    (again,) = book.actions(stepping)  # an event lost (a server restarted): told again
    assert again.devices == resize.devices
    book.ended("b", "finished")
    book.allocate(["b finished"])
    assert book.state.jobs["a"].devices == 4 and book.state.jobs["b"].devices == 0


def test_a_higher_priority_job_preempts_and_the_preempted_job_resumes_later() -> None:
    book, clock = book_of(devices=2)
    book.submitted("k1", 1.0, job("low", min_devices=2), lambda spec: Prediction({2: 1.0}))
    book.allocate(["low submitted"])
    book.actions({})
    book.state.jobs["low"].flow_run_id = "run-low"
    clock.now += 1
    book.submitted("k2", 2.0, job("high", min_devices=2, priority=3), lambda spec: Prediction({2: 1.0}))
    book.allocate(["high submitted"])
    actions = book.actions({"low": Measured(step_s={2: 1.0}, devices_now=2)})
    # high's run starts at once: its first segment waits for the pool's slots until low has stopped
    assert sorted(actions, key=lambda a: a.job_id) == [
        Start("high", book.state.jobs["high"].spec.on_devices(2)),
        Preempt("low", "the pool gives its devices to jobs ranked before it")]
    book.state.jobs["high"].flow_run_id = "run-high"
    assert book.actions({}) == []  # asked once; again only if it still runs a while later
    clock.now += RESEND_S + 1
    assert book.actions({}) == [Preempt("low", "the pool gives its devices to jobs ranked before it")]
    assert book.ended("low", "stopped") == "low stopped (preempted); it waits"
    book.ended("high", "finished")
    book.allocate(["high finished"])
    (restart,) = book.actions({})
    assert restart == Start("low", book.state.jobs["low"].spec.on_devices(2))


def test_measured_step_times_replace_and_rescale_predictions() -> None:
    predicted = {1: 1.0, 2: 0.5, 3: 0.4}
    assert blended(predicted, {}) == predicted
    assert blended(predicted, {2: 1.0}) == {1: 2.0, 2: 1.0, 3: 0.8}  # a host 2x slower than the model
    spec = job("c", min_devices=2, max_devices=3)
    assert counts_for(spec, 8) == [2, 3]


def test_a_job_that_fails_for_good_frees_its_devices_to_the_others() -> None:
    book, _ = book_of(devices=2)
    for key, name in (("k1", "a"), ("k2", "b")):
        book.submitted(key, float(len(key)), job(name, min_devices=2), lambda spec: Prediction({2: 1.0}))
    book.allocate(["a, b submitted"])
    assert (book.state.jobs["a"].devices, book.state.jobs["b"].devices) == (2, 0)
    book.actions({})
    book.state.jobs["a"].flow_run_id = "run-a"
    assert book.ended("a", "failed", "cannot make progress") == "a failed: cannot make progress"
    book.allocate(["a failed"])
    (start,) = book.actions({})
    assert start == Start("b", book.state.jobs["b"].spec.on_devices(2)) and book.state.jobs["a"].devices == 0
    assert not book.idle()


def test_a_pool_over_nodes_starts_and_tells_jobs_whole_nodes_and_frees_them() -> None:
    """Nodes a, b, c of 2 devices: each job is given whole nodes (its spec on those nodes, the
    pool's devices per node), told the nodes it keeps or gains, and a job's end frees its nodes."""
    clock = Clock()
    book = PoolBook(PoolState(pool="p", devices=6, nodes=["a", "b", "c"], devices_per_node=2),
                    PoolPolicy(horizon_s=600.0), clock)
    whole = counts_for(job("x"), 6, 2)
    assert whole == [2, 4, 6]
    per_node = {2: 1.0, 4: 0.5, 6: 0.34}
    assert book.submitted("k0", 0.5, job("placed", nodes=["a"], devices=2), lambda s: Prediction(per_node)) == \
        "refused placed: resources.nodes: a pool over nodes places its jobs; leave it out"
    assert book.submitted("k1", 1.0, job("big", devices=3), lambda s: Prediction(per_node)) == "big submitted"
    book.allocate(["big submitted"])
    (start,) = book.actions({})
    assert start.spec.resources.nodes == ["a", "b", "c"] and start.spec.resources.devices_per_node == 2
    assert start.spec.resources.devices == 6
    book.state.jobs["big"].flow_run_id = "run-big"
    clock.now += 5
    book.submitted("k2", 2.0, job("small", min_devices=1, max_devices=2, priority=2), lambda s: Prediction(per_node))
    decision = book.allocate(["small submitted"])
    big, small = book.state.jobs["big"], book.state.jobs["small"]
    assert small.devices == 2 and big.devices == 4, decision
    assert big.nodes == ["a", "b"] and small.nodes == ["c"], "big keeps its first nodes, small takes the one freed"
    assert decision.nodes == {"big": ["a", "b"], "small": ["c"]}
    actions = book.actions({"big": Measured(step_s={6: 0.34}, last_step=3, devices_now=6)})
    assert sorted(actions, key=lambda a: a.job_id) == [
        Resize("big", 4, 6, ["a", "b"]), Start("small", book.state.jobs["small"].spec.on_nodes(["c"]))]
    book.state.jobs["small"].flow_run_id = "run-small"
    assert book.ended("big", "failed", "cannot make progress") == "big failed: cannot make progress"
    book.allocate(["big failed"])
    assert (big.devices, big.nodes, small.devices) == (0, None, 2)
    assert not book.state.decisions[-1].nodes.get("big") and book.state.decisions[-1].nodes["small"] == ["c"]
    book.submitted("k3", 3.0, job("next", devices=4), lambda s: Prediction(per_node))
    book.allocate(["next submitted"])
    (start,) = book.actions({"small": Measured(step_s={2: 1.0}, last_step=2, devices_now=2)})
    assert start == Start("next", book.state.jobs["next"].spec.on_nodes(["a", "b"])), "the failed job's nodes"


def test_a_node_that_leaves_takes_its_devices_out_of_the_pool_until_it_is_back() -> None:
    """Nodes a, b of 2 devices, one job on both: node b's worker goes offline; the job is given
    node a alone and told so; b's devices go to nobody until b is back, then the job has both."""
    clock = Clock()
    book = PoolBook(PoolState(pool="p", devices=4, nodes=["a", "b"], devices_per_node=2),
                    PoolPolicy(horizon_s=600.0), clock)
    assert book.nodes_seen(["a", "b"]) is None, "every node up, as assumed"
    book.submitted("k1", 1.0, job("x", devices=4), lambda s: Prediction({2: 1.0, 4: 0.5}))
    book.allocate(["x submitted"])
    (start,) = book.actions({})
    assert start.spec.resources.nodes == ["a", "b"]
    book.state.jobs["x"].flow_run_id = "run-x"
    assert book.nodes_seen(["a"]) == "node b left"
    decision = book.allocate(["node b left"])
    assert decision.devices == {"x": 2} and decision.nodes == {"x": ["a"]}
    (told,) = book.actions({"x": Measured(step_s={4: 0.5}, last_step=5, devices_now=4)})
    assert told == Resize("x", 2, 4, ["a"])
    clock.now += RESEND_S + 1  # a job across nodes that runs on fewer than told lost a node: not sent back
    assert book.actions({"x": Measured(step_s={2: 1.0}, last_step=9, devices_now=1)}) == []
    assert book.actions({"x": Measured(step_s={4: 0.5}, last_step=9, devices_now=4)}) == [Resize("x", 2, 2, ["a"])]
    book.submitted("k2", clock.now, job("y", devices=2), lambda s: Prediction({2: 1.0, 4: 0.5}))
    book.allocate(["y submitted"])
    assert book.state.jobs["y"].devices == 0, book.state.decisions[-1]
    assert book.nodes_seen(["a", "b", "c"]) == "node b joined", "a worker of no node of the pool is not one"
    decision = book.allocate(["node b joined"])
    assert sum(decision.devices.values()) == 4 and all(len(n) * 2 == decision.devices[j]
                                                      for j, n in decision.nodes.items())


def submitted(tmp_path: Path, pool_devices: str, spec_text: str) -> tuple[Path, Any]:
    """`parashift submit` of a spec (its YAML) to a pool of `pool_devices` (YAML lines): the
    spec's path and the command's result."""
    from typer.testing import CliRunner

    from parashift.cli import app

    pool = tmp_path / "pool.yaml"
    pool.write_text(f"name: p\n{pool_devices}\nstorage: {{url: 'file://{tmp_path}/store'}}\n")
    spec = tmp_path / "job.yaml"
    spec.write_text(spec_text)
    return spec, CliRunner().invoke(app, ["submit", str(spec), "--pool", str(pool)])


def test_submit_refuses_a_spec_a_pool_over_nodes_cannot_place(tmp_path: Path) -> None:
    over_nodes = "nodes: [a, b]\ndevices_per_node: 2"
    spec, out = submitted(tmp_path, over_nodes, "name: placed\nresources: {nodes: [a], devices_per_node: 2}\n")
    assert out.exit_code == 1 and f"{spec}: resources.nodes: a pool over nodes places its jobs" in out.output, out.output
    _, out = submitted(tmp_path, over_nodes, "name: fits\nresources: {devices: 3}\n")
    assert out.exit_code == 0 and "fits submitted to pool p" in out.output, out.output


def test_pool_status_shows_each_job_s_devices_progress_and_why_from_storage(tmp_path: Path) -> None:
    """`parashift pool POOL --status`: the pool seen from a terminal (the UI's artifacts need a
    server): its line, then a row per job with the last decision's reason; a submission the
    controller has not taken in yet is counted."""
    from parashift.pool.state import submit, write_state
    from parashift.storage import ObjectStore
    from typer.testing import CliRunner

    from parashift.cli import app

    book, _ = book_of(devices=2)
    book.state.pool = "lab"
    book.submitted("k1", 1.0, job("low", min_devices=2), lambda spec: Prediction({2: 1.0}))
    book.submitted("k2", 2.0, job("high", min_devices=2, priority=3), lambda spec: Prediction({2: 1.0}))
    book.allocate(["low, high submitted"])
    book.state.jobs["high"].status, book.state.jobs["high"].steps_done = "running", 250
    store = ObjectStore(f"file://{tmp_path}/store")
    write_state(store, book.state)
    submit(store, "lab", job("later"))
    (tmp_path / "pool.yaml").write_text(f"name: lab\ndevices: 2\nstorage: {{url: 'file://{tmp_path}/store'}}\n")
    shown = CliRunner().invoke(app, ["pool", str(tmp_path / "pool.yaml"), "--status"], env={"COLUMNS": "200"})
    assert shown.exit_code == 0, shown.output
    lines = shown.output.splitlines()
    assert lines[0].startswith("pool lab: 2 devices (2 allocated), jobs: 1 running, 1 waiting; 1 submission not taken in"), lines
    high = next(line for line in lines[1:] if "high" in line)
    assert "running" in high and "250/1000" in high and "2..16" in high
    low = next(line for line in lines[1:] if " low " in line)
    assert "waiting" in low and "waits" in low


def test_a_finished_job_shows_every_step_done() -> None:
    """Progress comes from the job's metrics, read at the controller's ticks: a job that ended
    between two reads was shown "finished" at 80/120 steps (seen by hand: both jobs of a pool).
    A finished run has trained every step; a preempted one keeps what was read."""
    book, _ = book_of()
    book.submitted("k1", 1.0, job("done", steps=120), lambda spec: Prediction({1: 1.0, 2: 0.6}))
    book.submitted("k2", 2.0, job("preempted", steps=120), lambda spec: Prediction({1: 1.0, 2: 0.6}))
    book.allocate(["submitted"])
    for name in ("done", "preempted"):
        book.state.jobs[name].status, book.state.jobs[name].steps_done = "running", 80
    book.ended("done", "finished")
    book.ended("preempted", "stopped")
    assert book.state.jobs["done"].steps_done == 120 and book.state.jobs["preempted"].steps_done == 80


@pytest.mark.parametrize(("state_gb", "grows"), [(0.1, True), (1000.0, False)])
def test_before_a_job_has_measured_a_change_its_cost_is_its_state_s_move(state_gb: float, grows: bool) -> None:
    """Two jobs share 4 devices, 2 each; one finishes. The other doubles its speed on the 2 freed
    devices, a gain of ~250 s within the horizon: worth a change that reads 0.1 GB, not one that
    reads 1 TB at a local disk's ~1 GB/s (500 s onto each of 2 devices). A fixed cost (2 s, as
    before the cost model priced the state) moved both."""
    book, _ = book_of(4)
    for key, name in (("k1", "a"), ("k2", "b")):
        book.submitted(key, 1.0, job(name, devices=2, max_devices=4, warm_workers=True),
                       lambda spec: Prediction({2: 0.5, 4: 0.25}, int(state_gb * 1e9)))
    assert book.allocate(["submitted"]).devices == {"a": 2, "b": 2}
    book.actions({})
    cost = book.pool_job(book.state.jobs["a"]).change_cost_s
    assert cost == pytest.approx(1.5 + state_gb * 1e9 / (2 * 1e9)), "a planned change, and each device's share read"
    book.ended("b", "finished")
    decision = book.allocate(["b finished"])
    assert decision.devices["a"] == (4 if grows else 2), decision.reasons["a"]
    book.observed("a", Measured(step_s={2: 0.5}, change_cost_s=3.0, last_step=10, devices_now=2))
    assert book.pool_job(book.state.jobs["a"]).change_cost_s == 3.0, "what the job measured replaces the model's"


def test_a_submitted_job_s_prediction_holds_its_plans_step_times_and_its_model_s_state() -> None:
    from parashift.models import family_of
    from parashift.tasks.pool_jobs import predicted

    spec = job("a")
    prediction = predicted(spec, [1, 2])
    assert set(prediction.step_s) == {1, 2} and all(s > 0 for s in prediction.step_s.values())
    assert prediction.state_bytes == 12 * family_of(spec.model).graph(spec.model, 16, "fp32").n_params


def test_a_submission_whose_model_cannot_be_built_is_refused_and_the_pool_goes_on() -> None:
    """A spec only building its model finds wrong (an `hf` model type transformers does not
    know) raised out of the controller's tick at every start: one submission stopped the pool."""
    from parashift.models import ModelUnbuildable

    def cannot_build(spec: JobSpec) -> Prediction:
        raise ModelUnbuildable("model.config.model_type", "transformers knows no model type 'gpt_neoxx'")

    book, _ = book_of()
    assert book.submitted("k1", 1.0, job("bad"), cannot_build) == \
        "refused bad: model.config.model_type: transformers knows no model type 'gpt_neoxx'"
    assert book.state.jobs["bad"].status == "failed" and "gpt_neoxx" in (book.state.jobs["bad"].reason or "")
    assert book.submitted("k2", 2.0, job("good"), lambda spec: Prediction(LINEAR)) == "good submitted"
    assert book.allocate(["submitted"]).devices == {"good": 4}
