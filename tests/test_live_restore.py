"""State moved between live workers (issue 25): after a segment, ranks keep their committed
boxes in memory; the next segment's ranks take every box a live rank holds from its memory
(their own, or a peer's over the gloo group) and read only the rest from storage. Real
processes, the real saver and restore: the result equals a restore from storage alone bit for
bit, and a holder whose memory differs from the committed bytes is caught by the checksums."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent

# (old plan, new plan): who holds what, and what must come from where.
CASES = [
    # 2 -> 3 ranks: rank 2 holds nothing and takes everything from ranks 0 and 1, read from
    # their memory (the same machine); ranks 0 and 1 take their own half from memory and the
    # other half from their peer.
    {"job": "tp2-dp3", "old": "tp2", "new": "dp3"},
    # The same where no peer's memory can be read directly: everything crosses the gloo group.
    {"job": "tp2-dp3-group", "old": "tp2", "new": "dp3", "group_only": True},
    # 4 -> 2 ranks: the second pipeline stage's holders are gone: read from storage.
    {"job": "pp2xtp2-tp2", "old": "pp2xtp2", "new": "tp2"},
    # 4 -> 2 ranks, replicas: each remaining rank holds all it needs.
    {"job": "dp4-dp2", "old": "dp4", "new": "dp2"},
    # rank 1's memory differs from what it committed: its readers read storage instead.
    {"job": "tp2-dp3-corrupt", "old": "tp2", "new": "dp3", "corrupt": 1},
    # A planned change on warm workers: step 5 held and described by a pending manifest, not
    # saved. 2 -> 3 ranks: every box is held, restored from memory alone.
    {"job": "tp2-dp3-pending", "old": "tp2", "new": "dp3", "pending": True},
    # 4 -> 2 ranks: the second stage's holders are gone and nothing stores step 5: the ranks
    # agree to resume from the committed step 3 instead.
    {"job": "pp2xtp2-tp2-pending", "old": "pp2xtp2", "new": "tp2", "pending": True},
    # rank 1's memory differs from the pending manifest's CRCs: no storage has those bytes, so
    # the committed step 3 it is.
    {"job": "tp2-dp3-pending-corrupt", "old": "tp2", "new": "dp3", "pending": True, "corrupt": 1},
    # A failure on warm workers: rank 1 of 4 replicas died after step 5, which nothing
    # describes; the survivors hold it whole. 4 -> 3 ranks (the new rank 1 holds nothing): the
    # survivors describe step 5 from their memory (a share each; the lowest writes it), and
    # every rank restores it from there.
    {"job": "dp4-dp3-failure", "old": "dp4", "new": "dp3", "failure": 1},
    # The same under tensor parallelism: no survivor holds rank 1's shards, nothing is
    # described, and the ranks resume from the committed step 3.
    {"job": "tp2-dp2-failure", "old": "tp2", "new": "dp2", "failure": 1},
]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, int], dict]:
    out = tmp_path_factory.mktemp("live")
    cases = [{**case, "rendezvous": [str(out / f"{case['job']}.old"), str(out / f"{case['job']}.new")]} for case in CASES]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(HERE / "live_ranks.py"), str(rank), str(out), str(out / "store"),
                               json.dumps(cases)], env=env, start_new_session=True)
             for rank in range(4)]
    try:
        codes = [p.wait(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    assert codes == [0, 0, 0, 0]
    found = {}
    for rank in range(4):
        for row in json.loads((out / f"rank{rank}.json").read_text()):
            found[(row["case"], row["rank"])] = row
    return found


@pytest.mark.parametrize("case", [c["job"] for c in CASES])
def test_live_restore_equals_the_storage_path_bit_for_bit(results, case: str) -> None:
    rows = [row for (job, _), row in sorted(results.items()) if job == case]
    assert rows
    for row in rows:
        assert row["same_keys"] and row["bitwise"] and row["slices"], row


def test_bytes_come_from_live_ranks_where_they_hold_them(results) -> None:
    tp2_dp3 = results[("tp2-dp3", 0)]["totals"]
    assert tp2_dp3["store"] == 0 and tp2_dp3["live"] == tp2_dp3["read"] == tp2_dp3["needed"] > 0
    # Ranks 0 and 1 each hold half of what all three need; the rest crosses the group.
    assert tp2_dp3["network"] > tp2_dp3["live"] / 2
    assert results[("tp2-dp3", 2)]["holders"] == [0, 1] and results[("tp2-dp3", 2)]["peers"] == [0, 1]
    # How the bytes from peers travelled: read from their memory, or (told it cannot) over the group.
    for rank in range(3):
        direct, over_group = results[("tp2-dp3", rank)]["moved"], results[("tp2-dp3-group", rank)]["moved"]
        assert direct["memory"] > 0 and direct["group"] == 0, (rank, direct)
        assert over_group["memory"] == 0 and over_group["group"] == direct["memory"], (rank, over_group)

    pp = results[("pp2xtp2-tp2", 0)]["totals"]
    assert 0 < pp["live"] < pp["read"] and pp["store"] > 0

    dp = results[("dp4-dp2", 0)]["totals"]
    assert dp["live"] == dp["read"] and dp["network"] == 0 and dp["store"] == 0


def test_a_holder_whose_memory_differs_is_read_around(results) -> None:
    totals = results[("tp2-dp3-corrupt", 0)]["totals"]
    clean = results[("tp2-dp3", 0)]["totals"]
    # Some of what rank 1 held was read from storage instead, and nothing else changed.
    assert totals["store"] > 0 and totals["live"] < clean["live"]
    assert totals["needed"] == clean["needed"]


def test_boxes_held_exactly_are_restored_in_the_held_memory(results) -> None:
    """A box the rank already holds as the new plan needs it is read into that memory (no second
    copy of the state), and still equals the storage path (the bitwise test above)."""
    for row in results.values():
        assert row["in_held_memory"] == row["held"], row["case"]
    for rank in (0, 1):  # replicas: each remaining rank already holds every box it needs
        dp = results[("dp4-dp2", rank)]
        assert dp["held"] == dp["wanted"] and dp["wanted"]
    assert results[("tp2-dp3", 2)]["held"] == []  # a new rank holds nothing


def test_a_pending_step_is_restored_from_live_ranks_alone(results) -> None:
    """Step 5 was never written: every rank restored it from live memory (no byte from
    storage), marked pending, equal to the state that was held; nothing was written for it but
    its pending manifest."""
    rows = [row for (job, _), row in sorted(results.items()) if job == "tp2-dp3-pending"]
    assert len(rows) == 3
    for row in rows:
        assert row["step"] == 5 and row["pending"] and row["slices"], row
        assert row["pending_steps"] == [5] and row["folders"] == [3], row
    totals = rows[0]["totals"]
    assert totals["store"] == 0 and totals["live"] == totals["read"] == totals["needed"] > 0


def test_a_step_the_survivors_of_a_failure_hold_whole_is_described_and_restored_from_them(results) -> None:
    """Step 5 was never saved nor described: the survivors that hold it whole checksummed it
    between them and the lowest wrote its pending manifest, and every rank of the new segment restored it from the survivors' memory
    (no byte from storage), equal to the state that was held; where survivors hold only shards,
    the committed step 3 it is, as before."""
    rows = [row for (job, _), row in sorted(results.items()) if job == "dp4-dp3-failure"]
    assert len(rows) == 3
    for row in rows:
        assert row["recorders"] == [0, 2], row  # the new segment's ranks 0 and 2 survived; rank 1 is new
        assert row["step"] == 5 and row["pending"] and row["slices"], row
        assert row["pending_steps"] == [5] and row["folders"] == [3], row
    totals = rows[0]["totals"]
    assert totals["store"] == 0 and totals["live"] == totals["read"] == totals["needed"] > 0
    assert results[("dp4-dp3-failure", 1)]["holders"], "the new rank read every box from a survivor"
    sharded = [row for (job, _), row in sorted(results.items()) if job == "tp2-dp2-failure"]
    for row in sharded:
        assert row["recorders"] == [] and row["step"] == 3 and not row["pending"] and row["bitwise"], row
        assert row["pending_steps"] == [], row


@pytest.mark.parametrize("case", ["pp2xtp2-tp2-pending", "tp2-dp3-pending-corrupt"])
def test_a_pending_step_no_live_rank_can_serve_resumes_from_the_committed_one(results, case: str) -> None:
    """Bytes of the pending step held by no rank of the new segment, or held wrong: the ranks
    agree on the newest committed step instead, equal to the storage path bit for bit."""
    rows = [row for (job, _), row in sorted(results.items()) if job == case]
    assert rows
    for row in rows:
        assert row["step"] == 3 and not row["pending"] and row["bitwise"] and row["slices"], row


@pytest.mark.parametrize(("plan", "devices", "held"), [
    ("dp4", 2, True),  # replicas: the first two ranks hold every box
    ("dp2", 1, True),  # rank 1's generator state is not needed on one device
    ("tp2", 1, False),  # rank 1's shards are held by rank 1 alone
    ("tp2", 3, True),  # every rank stays
    ("pp2xtp2", 2, False),  # four distinct holdings: two ranks cannot hold them
    ("pp2xdp2", 2, True),  # one rank of each stage is kept (the first two held stage 0 alone)
    ("dp2xtp2", 2, True),  # one rank of each tp shard
    ("dp2xtp2", 1, False),
])
def test_a_step_is_held_for_the_next_segment_only_where_the_ranks_kept_hold_every_box(plan: str, devices: int,
                                                                                      held: bool) -> None:
    from parashift.trainer.layout import state_layout
    from parashift.trainer.state import held_by_kept
    from test_reconfig import CONFIG, PLANS

    assert held_by_kept(state_layout(PLANS[plan], CONFIG), devices) is held


@pytest.mark.parametrize(("plan", "holders"), [("dp4", 3), ("dp4", 2), ("dp3", 4), ("dp2xtp2", 1)])
def test_a_held_step_described_in_shares_is_the_manifest_one_holder_describes(tmp_path: Path, plan: str,
                                                                              holders: int) -> None:
    """A failure's survivors split the held step's checksum pass (`record_shares`): every rank
    of the old layout in exactly one share, and the manifest from their shares' records is the
    one a single holder describes alone, record for record and CRC for CRC."""
    import torch
    from parashift.storage import CheckpointStore, ObjectStore
    from parashift.trainer.checkpoint.saver import describe_held, held_manifest, held_records, record_shares
    from parashift.trainer.layout import state_layout
    from test_reconfig import CONFIG, PLANS

    layout = state_layout(PLANS[plan], CONFIG)
    store = CheckpointStore(ObjectStore(f"file://{tmp_path}"), "job")
    generator = torch.Generator().manual_seed(0)
    # Each box's stored bytes (their dim order does not matter to their checksums): random.
    stored = {(name, box): torch.randint(0, 256, (box.numel * layout.tensors[name].itemsize,), dtype=torch.uint8,
                                         generator=generator)
              for name, box, _ in layout.distinct_slices()}
    shares = record_shares(layout, holders)
    assert sorted(r for share in shares for r in share) == list(range(layout.world_size))
    records = {}
    for share in shares:
        records.update(held_records(store, layout, stored, share))
    facts = ({"consumed": 7}, {"mesh": {}}, {"loss": 1.0}, 3)
    alone = describe_held(store, layout, 5, stored, *facts).model_dump(exclude={"created_at"})
    split = held_manifest(store.job_id, layout, 5, records, *facts).model_dump(exclude={"created_at"})
    assert split == alone and any(t["slices"] for t in alone["tensors"].values())


def test_a_held_step_a_holder_could_not_checksum_is_not_described(tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """One survivor's share failed: the writer writes no pending manifest (one WARNING line), and
    the job goes on from its newest commit, as when the write itself fails."""
    import torch
    from parashift.storage import CheckpointStore, ObjectStore
    from parashift.trainer.checkpoint.live import HeldState, LivePeers, Unrecorded
    from parashift.trainer.layout import state_layout
    from test_reconfig import CONFIG, PLANS

    layout = state_layout(PLANS["dp2"], CONFIG)
    boxes = [(name, box, tuple(range(len(box.lengths)))) for name, box, _ in layout.distinct_slices()]
    data = [torch.zeros(box.numel * layout.tensors[name].itemsize, dtype=torch.uint8) for name, box, _ in boxes]
    held = HeldState("job", 5, boxes, data, Unrecorded(layout, {"consumed": 1}, {}, {}))
    peers = LivePeers(5, {0: boxes, 1: boxes}, None, held, recorders=[0, 1])
    store = CheckpointStore(ObjectStore(f"file://{tmp_path}"), "job")
    with caplog.at_level("WARNING", logger="parashift.checkpoint"):
        assert peers._write_pending(store, [{}, "rank 1: OSError('boom')"], 3) is None
    assert "not described (rank 1: OSError('boom'))" in caplog.text and store.pending_steps() == []


def test_only_a_stop_object_that_names_the_next_device_count_announces_a_change(tmp_path: Path) -> None:
    """Warm workers hold a step instead of saving it only for a planned change: a stop object
    the launcher wrote for a re-plan (with `devices`); `parashift stop`'s, or none, is a plain stop."""
    import signal

    from parashift.storage import JobPaths, ObjectStore
    from parashift.trainer.control import STOP_SIGNAL, StopRequests

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, STOP_SIGNAL)}
    store = ObjectStore(f"file://{tmp_path}")
    try:
        stops = StopRequests(store, "job", poll_every_s=0)  # installs the worker's signal handlers
        assert stops.next_devices() is None
        for said, devices in (({"reason": "stop"}, None), ({"reason": "rescale", "devices": 3}, 3),
                              ({"devices": 0}, None), ({"devices": True}, None), (["junk"], None)):
            store.put_json(JobPaths("job").stop(), said)
            assert stops.next_devices() == devices, said
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def test_a_job_shrinking_on_warm_workers_keeps_the_processes_that_hold_its_state(tmp_path: Path) -> None:
    """pp 2 x dp 2 on four warm workers, then dp 2 on two: the pool keeps one rank of each stage
    (`launcher.warm_pool`; keeping the first two kept stage 0 twice, and stage 1 was read from
    storage). Every byte of the step comes from their memory, and the losses are a static run's."""
    from jobs import assert_losses_match, mesh_plan, run, tiny_spec
    from parashift.specs.plan import Plan

    model, training = {"n_layers": 2}, {"steps": 8, "checkpoint_every": 4}
    static = run(tiny_spec("static-shrink", f"file://{tmp_path}/static", model=model, training=training),
                 Plan.data_parallel(2))
    spec = tiny_spec("shrink", f"file://{tmp_path}/store", model=model, training=training)
    first = run(spec, mesh_plan({"pp": 2, "dp": 2}, micro_batches=2), until_step=4)
    second = run(spec, Plan.data_parallel(2))
    assert second.start is not None and second.start.step == 4
    moved = second.start.restore_bytes or {}
    assert moved["store"] == 0 and moved["live"] == moved["read"] == moved["needed"] > 0, moved
    losses = [loss for _, loss in sorted({e.step: e.loss for e in static.steps}.items())]
    assert_losses_match(first, losses)
    assert_losses_match(second, losses)
