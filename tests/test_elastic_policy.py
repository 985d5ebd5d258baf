"""The elastic policy (`specs.elastic`), rule by rule as docs/elastic.md states them: plain
function calls, no Prefect server, no worker processes."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from parashift.specs import JobSpec
from parashift.specs.elastic import (
    REASONS,
    Fail,
    Ignore,
    JobState,
    Replan,
    ResourceEvent,
    SegmentEnded,
    Stop,
    admit,
    check_change,
    decide,
    likely_counts,
    rejoined_nodes,
    segment_outcome,
)
from parashift.tasks.records import SegmentResult
from pydantic import ValidationError


def job_spec(**sections: Any) -> JobSpec:
    data: dict[str, Any] = {"name": "policy", "training": {"global_batch": 8, "micro_batch": 2, "steps": 100},
                            "resources": {"devices": 2}}
    data.update(sections)
    return JobSpec.model_validate(data)


ONE_NODE = job_spec()
NODES = job_spec(resources={"devices": 6, "nodes": ["a", "b", "c"]})


def segment(devices: int, start: int, final: int, outcome: str = "finished", reason: str | None = None,
            nodes: list[str] | None = None, left: list[str] | None = None) -> SegmentResult:
    return SegmentResult(devices=devices, start_step=start, final_step=final, outcome=outcome,  # type: ignore[arg-type]
                         reason=reason, nodes=nodes, left_nodes=left or [])


# Which events the job hears


def test_the_highest_epoch_wins() -> None:
    assert admit("policy", ResourceEvent(devices=3, epoch=11), highest_epoch=10) is None
    for stale in (10, 5):
        ignored = admit("policy", ResourceEvent(devices=3, epoch=stale), highest_epoch=10)
        assert isinstance(ignored, Ignore) and ignored.epoch == stale
        assert f"epoch {stale}): epoch not above 10" in ignored.why
    # what the job already decided on is not decided again
    job = JobState(devices=2, epoch=20)
    ignored = decide(ONE_NODE, job, ResourceEvent(devices=3, epoch=20))
    assert isinstance(ignored, Ignore) and "not above 20" in ignored.why


def test_another_jobs_event_is_ignored() -> None:
    ignored = admit("policy", ResourceEvent(devices=3, epoch=99), highest_epoch=-1, sent_to="other")
    assert isinstance(ignored, Ignore) and "for job other" in ignored.why
    assert admit("policy", ResourceEvent(devices=3, epoch=99), highest_epoch=-1, sent_to="policy") is None


def test_ignored_events_are_logged_with_the_reason(caplog: pytest.LogCaptureFixture) -> None:
    from parashift.tasks.events import ResourceWatcher

    watcher = ResourceWatcher("policy", logger=logging.getLogger("test.policy"))
    with caplog.at_level(logging.INFO, logger="test.policy"):
        assert watcher.offer(ResourceEvent(devices=3, epoch=10))
        assert not watcher.offer(ResourceEvent(devices=4, epoch=7))
        assert not watcher.offer(ResourceEvent(devices=4, epoch=12), job_id="other")
    ignored = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert ignored == ["resource change ignored: 4 devices (scale, epoch 7): epoch not above 10",
                       "resource change ignored: 4 devices (scale, epoch 12) is for job other"]
    assert watcher.latest == ResourceEvent(devices=3, epoch=10)
    assert watcher.newest_after(9) == watcher.latest and watcher.newest_after(10) is None


# What a heard event does


def test_a_new_device_count_replans_and_the_same_one_does_nothing() -> None:
    job = JobState.starting(ONE_NODE)
    assert (job.devices, job.nodes, job.step, job.epoch) == (2, None, 0, -1)
    decision = decide(ONE_NODE, job, ResourceEvent(devices=3, epoch=10, reason="scale-up"))
    assert decision == Replan(3, None, "scale-up", "scale-up: 2 devices -> 3 devices", epoch=10)
    job = job.following(decision)
    assert (job.devices, job.epoch) == (3, 10)
    same = decide(ONE_NODE, job, ResourceEvent(devices=3, epoch=11))
    assert isinstance(same, Ignore) and "runs on 3 devices already" in same.why
    assert decide(ONE_NODE, job, ResourceEvent(devices=1, epoch=12)).why == "scale: 3 devices -> 1 device"
    assert job.following(same).epoch == 11 and job.following(same).devices == 3


def test_no_device_gets_less_than_one_sequence_per_step() -> None:
    job = JobState.starting(ONE_NODE)
    assert isinstance(decide(ONE_NODE, job, ResourceEvent(devices=8, epoch=1)), Replan)  # global_batch 8
    too_many = decide(ONE_NODE, job, ResourceEvent(devices=9, epoch=1))
    assert isinstance(too_many, Ignore) and "exceed training.global_batch (8)" in too_many.why
    with pytest.raises(ValueError, match="global_batch"):
        check_change(ResourceEvent(devices=9, epoch=1), ONE_NODE)  # what `parashift scale SPEC` refuses up front


def test_a_change_outside_the_job_s_own_bounds_is_refused() -> None:
    """`parashift scale --devices 1` of a job with min_devices 2 moved it onto 1 device: its
    min_devices and max_devices bound what an event gives it, as they bound its spec."""
    bounded = job_spec(resources={"devices": 2, "min_devices": 2, "max_devices": 4})
    job = JobState.starting(bounded)
    below = decide(bounded, job, ResourceEvent(devices=1, epoch=1))
    assert isinstance(below, Ignore) and "1 device: below resources.min_devices (2)" in below.why
    above = decide(bounded, job, ResourceEvent(devices=5, epoch=2))
    assert isinstance(above, Ignore) and "5 devices: above resources.max_devices (4)" in above.why
    assert isinstance(decide(bounded, job, ResourceEvent(devices=4, epoch=3)), Replan)
    with pytest.raises(ValueError, match="min_devices"):
        check_change(ResourceEvent(devices=1, epoch=1), bounded)  # what `parashift scale SPEC` refuses up front


def test_a_job_on_one_node_takes_devices_not_nodes() -> None:
    ignored = decide(ONE_NODE, JobState.starting(ONE_NODE), ResourceEvent(nodes=["a"], epoch=1))
    assert isinstance(ignored, Ignore) and "runs on one node" in ignored.why


def test_a_job_across_nodes_takes_node_lists_and_whole_nodes() -> None:
    job = JobState.starting(NODES)
    assert job.nodes == ["a", "b", "c"]
    assert decide(NODES, job, ResourceEvent(nodes=["a", "c"], epoch=1)) == Replan(
        4, ["a", "c"], "scale", "scale: 6 devices -> nodes a,c", epoch=1)
    assert decide(NODES, job, ResourceEvent(devices=2, epoch=1)) == Replan(
        2, ["a"], "scale", "scale: 6 devices -> 2 devices", epoch=1)
    assert "not whole nodes of 2" in decide(NODES, job, ResourceEvent(devices=3, epoch=1)).why  # type: ignore[union-attr]
    more = decide(NODES, JobState(devices=2, nodes=["a"]), ResourceEvent(devices=4, epoch=1))
    assert isinstance(more, Ignore) and "need more nodes than the 1 running" in more.why
    same = decide(NODES, job, ResourceEvent(devices=6, epoch=1))
    assert isinstance(same, Ignore) and "runs on nodes a,b,c already" in same.why


# Failures


def test_a_failure_resumes_on_one_device_fewer() -> None:
    job = JobState(devices=3, step=0)
    failed = segment(3, 0, 10, "failed", "rank 1 killed by signal 9 (torchrun exited with 1)")
    decision = decide(ONE_NODE, job, SegmentEnded(failed))
    assert isinstance(decision, Replan)
    assert (decision.devices, decision.nodes, decision.reason, decision.announce) == (2, None, "failure", True)
    assert decision.why == ("worker failure on 3 devices (rank 1 killed by signal 9 (torchrun exited with 1)): "
                            "resuming from step 10 on 2 devices")
    assert decision.as_event(7) == ResourceEvent(devices=2, epoch=7, reason="failure")
    job = job.after(failed).following(decision, epoch=7)
    assert (job.devices, job.step, job.epoch, len(job.segments)) == (2, 10, 7, 1)
    # at least one device
    last = decide(ONE_NODE, JobState(devices=1), SegmentEnded(segment(1, 0, 4, "failed", "oom")))
    assert isinstance(last, Replan) and last.devices == 1


def test_the_counts_planned_ahead_are_where_the_policy_goes_next() -> None:
    """What PlansAhead plans while the job trains: the spec's next scripted count, then where a
    failure puts the job (the policy's own rule: one device fewer; across nodes, one node
    fewer), then the counts it ran on, newest first, and the spec's; within the job's bounds."""
    job = JobState(devices=4, step=0).after(segment(2, 0, 5, "rescaled")).after(segment(6, 5, 9, "rescaled"))
    job = JobState(devices=4, step=9, segments=job.segments)
    assert likely_counts(ONE_NODE, job) == [3, 6, 2]  # failure, newest count, then the spec's (2, also run on)
    failed = decide(ONE_NODE, job, SegmentEnded(segment(4, 9, 12, "failed", "rank 1 killed")))
    assert isinstance(failed, Replan) and failed.devices == likely_counts(ONE_NODE, job)[0]
    scripted = job_spec(elasticity=[{"at_step": 20, "devices": 5}])
    assert likely_counts(scripted, job)[0] == 5
    bounded = job_spec(resources={"devices": 4, "min_devices": 4, "max_devices": 5})
    assert likely_counts(bounded, job) == []  # 3 below the minimum, 6 above the maximum, 2 below it too, 4 running
    assert likely_counts(ONE_NODE, JobState(devices=1)) == [2]  # no zero; the spec's count
    assert likely_counts(NODES, JobState(devices=6, nodes=["a", "b", "c"])) == [4]  # a node less (6: running)


def test_two_failures_in_a_row_without_progress_fail_the_job() -> None:
    first = segment(2, 4, 4, "failed", "rank 0 killed by signal 9")
    job = JobState(devices=2, step=4).after(first)
    second = segment(1, 4, 4, "failed", "rank 0 killed by signal 9 again")
    decision = decide(ONE_NODE, job, SegmentEnded(second))
    assert isinstance(decision, Fail)
    assert decision.why == ("policy cannot make progress: two failures in a row without a new checkpoint "
                            "(last: rank 0 killed by signal 9 again); the last committed step is 4")
    # a failure that committed a new step, or one after a segment that did not fail, is retried
    progressed = JobState(devices=2).after(segment(2, 0, 4, "failed", "x"))
    assert isinstance(decide(ONE_NODE, progressed, SegmentEnded(second)), Replan)
    after_rescale = JobState(devices=2).after(segment(2, 4, 4, "rescaled"))
    assert isinstance(decide(ONE_NODE, after_rescale, SegmentEnded(second)), Replan)
    made_progress = segment(1, 4, 6, "failed", "y")
    assert isinstance(decide(ONE_NODE, job, SegmentEnded(made_progress)), Replan)


def test_a_node_that_leaves_is_a_failure_on_the_nodes_left() -> None:
    job = JobState.starting(NODES)
    left = segment(6, 0, 10, "failed", "node b left", nodes=["a", "b", "c"], left=["b"])
    decision = decide(NODES, job, SegmentEnded(left))
    assert decision == Replan(4, ["a", "c"], "node-left",
                              "node failure on 6 devices (node b left): resuming from step 10 on nodes a,c",
                              announce=True)
    gone = segment(6, 0, 10, "failed", "nodes a, b, c left", nodes=["a", "b", "c"], left=["a", "b", "c"])
    every = decide(NODES, job, SegmentEnded(gone))
    assert isinstance(every, Fail) and "every node left (a, b, c)" in every.why
    # a worker that died on a node that stayed: the same nodes again
    died = segment(6, 0, 10, "failed", "rank 4 killed", nodes=["a", "b", "c"])
    again = decide(NODES, job, SegmentEnded(died))
    assert isinstance(again, Replan) and (again.devices, again.nodes, again.reason) == (6, ["a", "b", "c"], "failure")


def test_a_node_that_comes_back_is_taken_in_again() -> None:
    assert rejoined_nodes(NODES, running=["a"], back=["c"]) == ["a", "c"]
    assert rejoined_nodes(NODES, running=["c"], back=["b", "a"]) == ["a", "b", "c"]  # the spec's order
    job = JobState(devices=2, nodes=["a"], epoch=3)
    decision = decide(NODES, job, ResourceEvent(nodes=["a", "c"], epoch=4, reason="node-joined"))
    assert decision == Replan(4, ["a", "c"], "node-joined", "node-joined: 2 devices -> nodes a,c", epoch=4)


def test_only_a_node_that_left_is_watched_for_its_return_not_one_an_event_let_go() -> None:
    """`JobState.left`: the nodes lost to a departure, which the flow's node watch takes back.
    `parashift scale --nodes a` was undone 4 s later at node b's next heartbeat (every node of
    the spec the job did not run on counted as left)."""
    job = JobState.starting(NODES)
    lost = job.following(decide(NODES, job, SegmentEnded(
        segment(6, 0, 10, "failed", "node b left", nodes=["a", "b", "c"], left=["b"]))))
    assert (lost.nodes, lost.left) == (["a", "c"], ("b",))
    crashed = lost.following(decide(NODES, lost, SegmentEnded(  # a worker's crash on a node that stays
        segment(4, 10, 20, "failed", "rank 1 killed", nodes=["a", "c"]))))
    assert (crashed.nodes, crashed.left) == (["a", "c"], ("b",))
    back = crashed.following(decide(NODES, crashed, ResourceEvent(nodes=["a", "b", "c"], epoch=5, reason="node-joined")))
    assert (back.nodes, back.left) == (["a", "b", "c"], ())
    asked = JobState.starting(NODES).following(decide(NODES, JobState.starting(NODES),
                                                      ResourceEvent(nodes=["a"], epoch=6)))
    assert (asked.nodes, asked.left) == (["a"], ())  # let go: not taken back by itself
    # a node lost, then an event naming the nodes: what the event names is what the job wants
    named = lost.following(decide(NODES, lost, ResourceEvent(nodes=["a"], epoch=7)))
    assert (named.nodes, named.left) == (["a"], ())


# How segments end, and what follows


def test_a_finished_segment_follows_the_script_or_ends_the_job() -> None:
    spec = job_spec(elasticity=[{"at_step": 4, "devices": 3, "reason": "scale-up"},
                                {"at_step": 8, "devices": 3}, {"at_step": 12, "devices": 1, "reason": "failure"}])
    job = JobState.starting(spec)
    scripted = spec.scripted_change_after(0)
    decision = decide(spec, job, SegmentEnded(segment(2, 0, 4), scripted))
    assert decision == Replan(3, None, "scale-up", "scripted change at step 4 to 3 devices (scale-up)")
    job = job.after(segment(2, 0, 4)).following(decision)
    assert (job.devices, job.step, job.epoch) == (3, 4, -1)  # a scripted change is no event
    same = decide(spec, job, SegmentEnded(segment(3, 4, 8), spec.scripted_change_after(4)))
    assert isinstance(same, Ignore) and "runs on 3 devices already" in same.why
    assert decide(spec, job, SegmentEnded(segment(3, 12, 100))) == Stop("finished at step 100")
    assert isinstance(decide(spec, job, SegmentEnded(segment(3, 90, 100), scripted)), Stop)  # at the last step
    whole = job_spec(resources={"devices": 6, "nodes": ["a", "b", "c"]},
                     elasticity=[{"at_step": 4, "devices": 3}])
    halves = decide(whole, JobState.starting(whole), SegmentEnded(segment(6, 0, 4), whole.scripted_change_after(0)))
    assert isinstance(halves, Ignore) and "not whole nodes" in halves.why


def test_a_job_resumed_mid_script_starts_where_the_script_has_it() -> None:
    """A job stopped at step 95 of 2 -> 3 (step 20) -> 4 (step 40) resumes on 4 devices and
    trains to its end: not on the spec's first count up to the step-20 change it is past (found
    by resuming specs/elastic-example.yaml: a no-op segment, then the step-20 change, on 2)."""
    spec = job_spec(elasticity=[{"at_step": 20, "devices": 3}, {"at_step": 40, "devices": 4}])
    for step, devices in ((0, 2), (19, 2), (20, 3), (39, 3), (40, 4), (95, 4)):
        job = JobState.starting(spec, step)
        assert (job.devices, job.step) == (devices, step)
    resumed = JobState.starting(spec, 95)
    assert spec.scripted_change_after(resumed.step) is None
    ended = decide(spec, resumed, SegmentEnded(segment(4, 95, 100), spec.scripted_change_after(95)))
    assert ended == Stop("finished at step 100")
    nodes = job_spec(resources={"devices": 6, "nodes": ["a", "b", "c"]}, elasticity=[{"at_step": 4, "devices": 4}])
    assert (JobState.starting(nodes, 5).devices, JobState.starting(nodes, 5).nodes) == (4, ["a", "b"])
    # a change that cannot apply there (not whole nodes) leaves the spec's devices, as it would at its step
    halves = job_spec(resources={"devices": 6, "nodes": ["a", "b", "c"]}, elasticity=[{"at_step": 4, "devices": 3}])
    assert JobState.starting(halves, 5).devices == 6


def test_stopped_and_fatal_segments() -> None:
    job = JobState(devices=2)
    assert decide(ONE_NODE, job, SegmentEnded(segment(2, 0, 5, "stopped"))) == Stop("asked to stop at step 5")
    assert decide(ONE_NODE, job, SegmentEnded(segment(2, 0, 0, "fatal", "no usable checkpoint"))) == Fail(
        "no usable checkpoint")
    assert isinstance(decide(ONE_NODE, job, SegmentEnded(segment(2, 0, 0, "fatal"))), Fail)


def test_a_segment_stopped_for_a_change_replans_for_the_newest_one() -> None:
    job = JobState(devices=2, epoch=5)
    rescaled = segment(2, 0, 7, "rescaled", "scale: 2 devices -> 3 devices")
    pending = ResourceEvent(devices=3, epoch=10)
    assert decide(ONE_NODE, job, SegmentEnded(rescaled, pending=pending)) == Replan(
        3, None, "scale", "scale: 2 devices -> 3 devices", epoch=10)
    # a newer event asked for what runs: nothing to re-plan; none pending: go on
    assert isinstance(decide(ONE_NODE, job, SegmentEnded(rescaled, pending=ResourceEvent(devices=2, epoch=11))),
                      Ignore)
    assert isinstance(decide(ONE_NODE, job, SegmentEnded(rescaled)), Ignore)


def test_segment_outcomes() -> None:
    common: dict[str, Any] = {"start_step": 4, "returncode": 0}
    assert segment_outcome(**common, ended_at=12, stopped=False) == ("finished", None, 12)
    assert segment_outcome(**common, ended_at=7, stopped=True) == ("stopped", None, 7)
    # torchrun exits non-zero when it was signalled itself; the workers' report is what counts
    assert segment_outcome(start_step=4, returncode=1, ended_at=7, stopped=True) == ("stopped", None, 7)
    replan = Replan(3, None, "scale", "scale: 2 devices -> 3 devices", epoch=10)
    assert segment_outcome(**common, ended_at=7, stopped=True, stopped_for=replan) == (
        "rescaled", "scale: 2 devices -> 3 devices", 7)
    assert segment_outcome(**common, ended_at=7, stopped=True, stopped_for=Ignore("same")) == ("stopped", None, 7)
    # workers that stopped for a change (warm ones holding step 7 for it, or any at a scheduled
    # commit) that a newer event took back: the job goes on from step 7 (a pool told it 2 -> 3
    # and at once 3 -> 2), neither stopped nor that step lost
    taken_back = segment_outcome(**common, ended_at=7, stopped=True, stopped_for=Ignore("same"), stopped_for_change=True)
    assert taken_back[0] == "rescaled" and taken_back[2] == 7
    assert segment_outcome(**common, ended_at=None, stopped=False, fatal="no usable checkpoint") == (
        "fatal", "no usable checkpoint", 4)
    died = {"start_step": 4, "returncode": -9, "ended_at": None, "stopped": False, "failure": "rank 1 killed"}
    assert segment_outcome(**died, committed_step=8) == ("failed", "rank 1 killed", 8)
    assert segment_outcome(**died) == ("failed", "rank 1 killed", 4)  # nothing committed: where it started
    assert segment_outcome(**common, ended_at=12, stopped=False, left_nodes=["b"], committed_step=10) == (
        "failed", "node b left", 10)
    assert segment_outcome(**common, ended_at=None, stopped=False, left_nodes=["b", "c"])[1] == "nodes b, c left"
    assert segment_outcome(start_step=4, returncode=1, ended_at=12, stopped=False, failure="x")[0] == "failed"


# One vocabulary


def test_one_reason_vocabulary_for_specs_events_and_records() -> None:
    assert {"scale-up", "scale-down", "failure", "manual"} <= set(REASONS)  # what specs already say
    assert {"scale", "node-left", "node-joined"} <= set(REASONS)  # what events say
    spec = job_spec(elasticity=[{"at_step": 4, "devices": 1, "reason": "node-left"}])
    assert spec.elasticity[0].reason == "node-left"
    with pytest.raises(ValidationError):
        ResourceEvent(devices=2, epoch=1, reason="whatever")  # type: ignore[arg-type]
    with pytest.raises(ValidationError):
        job_spec(elasticity=[{"at_step": 4, "devices": 1, "reason": "whatever"}])


def test_a_failure_of_a_pinned_mesh_wider_than_its_batch_resumes_on_one_device_a_sequence() -> None:
    """dp 2 x tp 4 on 8 devices trains 2 sequences a step. One device fewer (7) would leave
    devices without a sequence (and no mesh of 7 runs it): it resumes on 2, and where 8 was a
    mesh of tp 4 over 4 sequences, on 4 (tp 4 kept by re-pinning, docs/plans.md)."""
    pinned = job_spec(training={"global_batch": 2, "micro_batch": 1, "steps": 100},
                      resources={"devices": 8}, parallelism={"strategy": "pinned", "mesh": {"dp": 2, "tp": 4}})
    failed = decide(pinned, JobState(devices=8), SegmentEnded(segment(8, 0, 10, "failed", "rank 3 killed")))
    assert isinstance(failed, Replan) and failed.devices == 2
    wider = job_spec(training={"global_batch": 4, "micro_batch": 1, "steps": 100},
                     resources={"devices": 8}, parallelism={"strategy": "pinned", "mesh": {"dp": 2, "tp": 4}})
    assert decide(wider, JobState(devices=8), SegmentEnded(segment(8, 0, 10, "failed", "x"))).devices == 4
    assert likely_counts(pinned, JobState(devices=8))[0] == 2
