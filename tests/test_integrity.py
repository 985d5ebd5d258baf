"""Nothing lost, nothing blocked: one writer per job enforced by storage (a lease with a fencing
token that every commit carries), manifests under a digest of their own, read by a reader per
format version, planning that skips what the workers would refuse, and step folders a save
never writes through.

Unit level, on real files and the real S3 server of the session (moto); small tensors."""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from parashift.ptc import Layout
from parashift.ptc.layout import Slice, TensorLayout
from parashift.storage import (
    LEASE_ENV,
    CheckpointStore,
    JobLease,
    JobLeaseHeld,
    JobPaths,
    LeaseLost,
    MalformedManifest,
    Manifest,
    ObjectNotFound,
    ObjectStore,
    StaleLineage,
    WriteConflict,
    encode_manifest,
)
from parashift.storage.lease import read_lease
from parashift.trainer.checkpoint import Checkpointer, reshard_plan, restore_latest

JOB = "integrity"
FIXTURE = Path(__file__).parent / "fixtures" / "format2"


def layout_of(world: int = 1, shape: tuple[int, int] = (4, 6)) -> Layout:
    """A weight sharded over the ranks along dim 0, a replicated bias, one RNG state per rank:
    what the format-2 fixture holds, for `world` ranks."""
    rows = shape[0] // world
    return Layout(world, {
        "model/w": TensorLayout("model/w", shape, "float32",
                                {r: Slice((r * rows, 0), (rows, shape[1])) for r in range(world)}, split_dim=0),
        "model/b": TensorLayout("model/b", (shape[1],), "float32", {r: Slice((0,), (shape[1],)) for r in range(world)}),
        **{f"rng/rank{r:05d}/cpu": TensorLayout(f"rng/rank{r:05d}/cpu", (8,), "uint8", {r: Slice((0,), (8,))})
           for r in range(world)},
    })


def state_of(shape: tuple[int, int] = (4, 6), seed: float = 0.0) -> dict[str, torch.Tensor]:
    return {"model/w": torch.arange(shape[0] * shape[1], dtype=torch.float32).reshape(shape) / 8 + seed,
            "model/b": -torch.arange(shape[1], dtype=torch.float32) + seed,
            "rng/rank00000/cpu": torch.arange(8, dtype=torch.uint8)}


def save(store: CheckpointStore, steps: list[int], shape: tuple[int, int] = (4, 6), keep: int = 10,
         resumed_from: Manifest | None = None) -> None:
    saver = Checkpointer(store, layout_of(1, shape), 0, keep=keep, resumed_from=resumed_from)
    try:
        for step in steps:
            saver.save(step, state_of(shape, float(step)), {"samples_consumed": 8 * step}, {}, {}, blocking=True)
    finally:
        saver.close()


def file_store(tmp_path: Path) -> ObjectStore:
    return ObjectStore(f"file://{tmp_path}/store")


def s3_store(endpoint: str, bucket: str) -> ObjectStore:
    return ObjectStore(f"s3://{bucket}/root", {"endpoint_url": endpoint})


@pytest.fixture(params=["file", "s3", "memory"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ObjectStore]:
    """file:// and s3:// (conditional writes the backend makes atomic), memory:// (one process:
    a lock makes them so)."""
    if request.param == "file":
        yield file_store(tmp_path)
    elif request.param == "s3":
        yield s3_store(request.getfixturevalue("s3_endpoint"), request.getfixturevalue("s3_bucket"))
    else:
        memory = ObjectStore(f"memory://integrity-{uuid.uuid4().hex[:12]}")
        assert memory.conditional_writes == "process"
        yield memory
        if memory.fs.exists(memory._root):  # the memory filesystem is process-global
            memory.fs.rm(memory._root, recursive=True)


def later(seconds: float):
    """A clock `seconds` ahead of this one (another host's, or this one later)."""
    return lambda: time.time() + seconds


# ---------------------------------------------------------------------------------- the lease


def test_conditional_writes_are_atomic(store: ObjectStore) -> None:
    """create: only where nothing is; replace: only over the version read."""
    tag = store.create("jobs/x/lease.json", b"first")
    with pytest.raises(WriteConflict):
        store.create("jobs/x/lease.json", b"second")
    assert store.get("jobs/x/lease.json") == b"first"
    data, read_tag = store.get_tagged("jobs/x/lease.json")
    assert data == b"first" and read_tag == tag
    new_tag = store.replace("jobs/x/lease.json", b"third", tag)
    with pytest.raises(WriteConflict):
        store.replace("jobs/x/lease.json", b"stale", tag)
    assert store.get_tagged("jobs/x/lease.json") == (b"third", new_tag)
    with pytest.raises((WriteConflict, ObjectNotFound)):
        store.replace("jobs/x/absent.json", b"x", tag)
    assert store.list("jobs/x") == ["jobs/x/lease.json"]  # no temporary file left behind


def test_a_create_race_has_one_winner(tmp_path: Path) -> None:
    store = file_store(tmp_path)
    start = threading.Barrier(8)
    won: list[int] = []

    def contend(i: int) -> None:
        start.wait()
        try:
            store.create("jobs/x/lease.json", f"writer {i}".encode())
            won.append(i)
        except WriteConflict:
            pass

    threads = [threading.Thread(target=contend, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1 and store.get("jobs/x/lease.json") == f"writer {won[0]}".encode()


def test_a_second_writer_is_refused_naming_the_holder(store: ObjectStore) -> None:
    first = JobLease(store, JOB)
    token = first.acquire()
    assert token.generation == 1
    with pytest.raises(JobLeaseHeld) as refused:
        JobLease(store, JOB).acquire()
    message = str(refused.value)
    assert "\n" not in message and f"job {JOB} is already running" in message
    assert first.run_id in message and f"pid {os.getpid()}" in message and "s more" in message
    assert 55 < refused.value.remaining_s <= 60
    first.release()  # released: the next run takes over at once
    assert JobLease(store, JOB).acquire().generation == 2


def test_checking_a_lease_refuses_as_acquiring_would_and_takes_nothing(store: ObjectStore) -> None:
    JobLease(store, JOB).check_free()  # no lease yet
    first = JobLease(store, JOB)
    first.acquire()
    before = read_lease(store, JOB)
    with pytest.raises(JobLeaseHeld, match=f"job {JOB} is already running"):
        JobLease(store, JOB).check_free()
    first.check_free()  # its own
    JobLease(store, JOB, clock=later(61)).check_free()  # lapsed: a run would take it over
    assert read_lease(store, JOB) == before  # read, never written
    first.release()
    JobLease(store, JOB).check_free()


def test_an_expired_lease_is_taken_over_with_the_next_generation(store: ObjectStore) -> None:
    crashed = JobLease(store, JOB)
    crashed.acquire()  # and never renewed
    successor = JobLease(store, JOB, clock=later(61))
    token = successor.acquire()
    assert token.generation == 2 and successor.previous is not None and successor.previous.run_id == crashed.run_id
    record, _ = read_lease(store, JOB)
    assert record is not None and record.token == token
    with pytest.raises(LeaseLost, match="taken over"):  # the crashed run, back: it learns at its next renewal
        crashed.renew()


def test_two_take_overs_at_once_have_one_winner(tmp_path: Path) -> None:
    store = file_store(tmp_path)
    JobLease(store, JOB).acquire()
    start = threading.Barrier(4)
    outcomes: list[Any] = []

    def take() -> None:
        lease = JobLease(store, JOB, clock=later(61))
        start.wait()
        try:
            outcomes.append(lease.acquire())
        except JobLeaseHeld as refused:
            outcomes.append(refused)

    threads = [threading.Thread(target=take) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [o for o in outcomes if not isinstance(o, JobLeaseHeld)]
    assert len(winners) == 1 and winners[0].generation == 2


def test_a_held_lease_is_renewed_and_a_crashed_one_lapses(tmp_path: Path) -> None:
    store = file_store(tmp_path)
    with JobLease(store, JOB, ttl_s=0.6).hold():
        time.sleep(1.0)  # past the TTL: renewed meanwhile
        with pytest.raises(JobLeaseHeld):
            JobLease(store, JOB).acquire()
    crashed = JobLease(store, JOB, ttl_s=0.3)
    crashed.acquire()  # a kill -9: nobody renews, nobody releases
    with pytest.raises(JobLeaseHeld):
        JobLease(store, JOB).acquire()
    time.sleep(0.4)
    assert JobLease(store, JOB).acquire().generation == crashed.token.generation + 1


def test_a_holder_gone_from_this_machine_is_taken_over_at_once(tmp_path: Path) -> None:
    """A `parashift run` killed with -9 on this machine: its process is gone, so its live lease
    is taken over without waiting for it to lapse; a live holder's is not."""
    import subprocess
    import sys

    store = file_store(tmp_path)
    code = ("import sys; from parashift.storage import ObjectStore; from parashift.storage.lease import JobLease; "
            f"JobLease(ObjectStore(sys.argv[1]), {JOB!r}).acquire()")
    subprocess.run([sys.executable, "-c", code, store.url], check=True, cwd=Path(__file__).parents[1])
    record, _ = read_lease(store, JOB)
    assert record is not None and record.remaining_s(time.time()) > 50  # live, and its holder exited
    assert JobLease(store, JOB).acquire().generation == 2
    with pytest.raises(JobLeaseHeld):  # this process holds it now, and runs
        JobLease(store, JOB).acquire()


def test_a_holder_learns_its_lease_was_taken(tmp_path: Path) -> None:
    store = file_store(tmp_path)
    lost: list[str] = []
    with pytest.raises(LeaseLost, match="taken over"), JobLease(store, JOB, ttl_s=0.3, on_lost=lost.append).hold():
        JobLease(store, JOB, clock=later(10)).acquire()  # its clock says the lease lapsed
        time.sleep(0.5)
    assert len(lost) == 1 and "generation 2" in lost[0]


# ---------------------------------------------------------------------------------- fenced commits


def test_a_stale_writer_cannot_commit(store: ObjectStore, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpts = CheckpointStore(store, JOB)
    old = JobLease(store, JOB)
    monkeypatch.setenv(LEASE_ENV, str(old.acquire()))
    save(ckpts, [4])
    assert ckpts.load_manifest(4).writer is not None and ckpts.load_manifest(4).writer.generation == 1
    new = JobLease(store, JOB, clock=later(61))  # the old run hangs past its TTL; another takes over
    new.acquire()
    with pytest.raises(LeaseLost) as refused:
        save(ckpts, [8], resumed_from=ckpts.load_manifest(4))
    message = str(refused.value)
    assert "step 8 of integrity not committed" in message and new.run_id in message and "\n" not in message
    assert ckpts.committed_steps() == [4]
    monkeypatch.setenv(LEASE_ENV, str(new.token))  # the new holder saves over what the stale one left
    save(ckpts, [8], resumed_from=ckpts.load_manifest(4))
    manifest = ckpts.load_manifest(8)
    assert ckpts.committed_steps() == [4, 8] and manifest.writer is not None and manifest.writer.generation == 2
    monkeypatch.delenv(LEASE_ENV)  # no token: unfenced, as benchmarks and tests that start workers by hand
    save(ckpts, [12], resumed_from=manifest)
    assert ckpts.load_manifest(12).writer is None


def test_a_lease_about_to_lapse_commits_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = file_store(tmp_path)
    lease = JobLease(store, JOB, clock=later(-55))  # renewed 55 s ago, not since
    monkeypatch.setenv(LEASE_ENV, str(lease.acquire()))
    with pytest.raises(LeaseLost, match="lapses in"):
        save(CheckpointStore(store, JOB), [4])


def test_a_manifest_only_continues_the_newest_committed_step(store: ObjectStore) -> None:
    ckpts = CheckpointStore(store, JOB)
    save(ckpts, [4])
    writer = Checkpointer(ckpts, layout_of(), 0, resumed_from=ckpts.load_manifest(4))  # knows 4
    save(ckpts, [8], resumed_from=ckpts.load_manifest(4))  # another writer, meanwhile
    with pytest.raises(StaleLineage, match=r"it continues step 4, but step\(s\) 8 were committed since"):
        writer.save(12, state_of(), {"samples_consumed": 96}, {}, {}, blocking=True)
    writer.close()
    assert ckpts.committed_steps() == [4, 8]
    with pytest.raises(StaleLineage):  # directly: previous_step 4 is not the newest committed step
        ckpts.check_lineage(12, 4, skipped={4})
    ckpts.check_lineage(12, 8, skipped={4})
    ckpts.check_lineage(12, 4, skipped={4, 8})  # 8 was there when the writer started: it chose 4


# ---------------------------------------------------------------------------------- manifests


def _edits(doc: dict[str, Any]) -> dict[str, Any]:
    """Every top-level field of a manifest, changed by hand (plausibly), one at a time."""
    w = doc["tensors"]["model/w"]
    return {
        "format_version": 2,
        "job_id": "another-job",
        "step": doc["step"] + 1,
        "created_at": "2020-01-01T00:00:00+00:00",
        "world_size": doc["world_size"] + 1,
        "previous_step": 0,
        "data_position": {"samples_consumed": doc["data_position"]["samples_consumed"] + 8},
        "plan": {"mesh": {"dp": 4}},
        "tensors": {**doc["tensors"], "model/w": {**w, "shape": [w["shape"][0], w["shape"][1] + 1]}},
        "objects": {k: {**o, "nbytes": o["nbytes"] + 4} for k, o in doc["objects"].items()},
        "metadata": {"loss": 0.5},
        "writer": {"generation": 7, "run_id": "someone"},
        "digest": "sha256:" + "0" * 64,
    }


def compact(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode()


def test_every_field_changed_by_hand_is_refused(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    ckpts = CheckpointStore(file_store(tmp_path), JOB)
    save(ckpts, [4, 8])
    path = tmp_path / "store" / JobPaths(JOB).manifest(8)
    original = path.read_bytes()
    doc = json.loads(original)
    assert doc["format_version"] == 3 and doc["digest"].startswith("sha256:") and list(doc)[-1] == "digest"
    assert compact(doc) == original
    assert set(_edits(doc)) == set(doc)  # every field
    for field, value in _edits(doc).items():
        path.write_bytes(compact({**doc, field: value}))  # in place, laid out as written
        with pytest.raises(MalformedManifest) as refused:
            ckpts.load_manifest(8)
        message = str(refused.value)
        assert "\n" not in message, field
        expected = {"format_version": "digest: Extra inputs are not permitted"}.get(field, "digest mismatch")
        assert expected in message, (field, message)
    path.write_bytes(compact({k: v for k, v in doc.items() if k != "digest"}))
    with pytest.raises(MalformedManifest, match="without its digest"):
        ckpts.load_manifest(8)
    path.write_bytes(json.dumps(doc, indent=2).encode())  # laid out otherwise: not what was checked
    with pytest.raises(MalformedManifest, match="without its digest"):
        ckpts.load_manifest(8)
    path.write_bytes(compact({**doc, "data_position": {"samples_consumed": 0}}))
    with caplog.at_level(logging.WARNING):  # the restore refuses it in one line and takes step 4
        restored = restore_latest(ckpts, layout_of(), 0)
    assert restored is not None and restored.step == 4
    refusals = [r.getMessage() for r in caplog.records if "refused the checkpoint at step 8" in r.getMessage()]
    assert len(refusals) == 1 and "digest mismatch" in refusals[0]
    path.write_bytes(original)
    assert ckpts.load_manifest(8).data_position == {"samples_consumed": 64}


def test_a_format_2_checkpoint_restores(tmp_path: Path) -> None:
    """tests/fixtures/format2: written by the format-2 code (see its README), read by the
    format-2 reader and upgraded in memory; resharded from 2 ranks onto 1."""
    shutil.copytree(FIXTURE / "jobs", tmp_path / "store" / "jobs")
    ckpts = CheckpointStore(file_store(tmp_path), "format2")
    raw = ckpts.read_manifest_bytes(4)
    assert json.loads(raw)["format_version"] == 2 and "digest" not in json.loads(raw)
    manifest = ckpts.load_manifest(4)
    assert manifest.format_version == 3 and manifest.writer is None and manifest.world_size == 2
    ckpts.verify(4)
    layout = layout_of(1)
    plan = reshard_plan(ckpts, layout)
    assert plan is not None and plan.step == 4
    restored = restore_latest(ckpts, layout, 0)
    assert restored is not None and restored.step == 4 and restored.data_position == {"samples_consumed": 32}
    expected = state_of()
    for name in ("model/w", "model/b", "rng/rank00000/cpu"):
        assert torch.equal(restored.tensors[name], expected[name]), name
    # A format-2 manifest with a field of format 3 is not one.
    doc = json.loads(raw)
    with pytest.raises(MalformedManifest, match="format 2 has no field 'writer'"):
        ckpts.parse_manifest(4, json.dumps({**doc, "writer": None}).encode())
    with pytest.raises(MalformedManifest, match=r"format 1; this parashift reads formats \[2, 3\]"):
        ckpts.parse_manifest(4, json.dumps({**doc, "format_version": 1}).encode())


# ---------------------------------------------------------------------------------- planning


def _forge(ckpts: CheckpointStore, step: int, doc: dict[str, Any]) -> None:
    """A manifest that parses (its digest is right) at `step`, written by hand."""
    manifest = Manifest.model_validate({**doc, "step": step, "format_version": 3})
    ckpts.store.put(ckpts.paths.manifest(step), encode_manifest(manifest))


def test_planning_skips_what_the_workers_refuse(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Newest first: 20 names an object through a link out of the store, 16 holds a 10^12-element
    RNG state of another rank, 12 declares the weight float32[1000000, 1000000], 8 is another
    model's (wider): the plan before a launch and the workers' restore both take 4, and each
    refusal is one line."""
    store = file_store(tmp_path)
    ckpts = CheckpointStore(store, JOB)
    save(ckpts, [4])
    save(ckpts, [8], shape=(4, 10), resumed_from=ckpts.load_manifest(4))
    doc = json.loads(ckpts.load_manifest(4).model_dump_json())
    huge = json.loads(json.dumps(doc))
    w = huge["tensors"]["model/w"]
    w["shape"] = [10**6, 10**6]
    w["slices"][0].update(lengths=[10**6, 10**6], nbytes=4 * 10**12, chunks=[[4 * 10**12, 0]])
    huge["objects"]["rank00000.bin"]["nbytes"] = 4 * 10**12 + 100
    _forge(ckpts, 12, huge)
    foreign = json.loads(json.dumps(doc))
    foreign["tensors"]["rng/rank00009/cpu"] = {
        "name": "rng/rank00009/cpu", "dtype": "uint8", "shape": [10**12], "slices": [
            {"tensor": "rng/rank00009/cpu", "offsets": [0], "lengths": [10**12], "object": "rank00009.bin",
             "byte_offset": 0, "nbytes": 10**12, "dim_order": [0], "chunks": [[10**12, 0]]}]}
    foreign["objects"]["rank00009.bin"] = {"key": "rank00009.bin", "nbytes": 10**12}
    _forge(ckpts, 16, foreign)
    _forge(ckpts, 20, doc)
    folder = tmp_path / "store" / ckpts.paths.ckpt_dir(20)
    (tmp_path / "outside.bin").write_bytes((folder.parent / "00000004" / "rank00000.bin").read_bytes())
    (folder / "rank00000.bin").symlink_to(tmp_path / "outside.bin")
    assert ckpts.committed_steps() == [4, 8, 12, 16, 20]  # every manifest parses

    layout = layout_of()
    with caplog.at_level(logging.WARNING, logger="parashift.checkpoint"):
        for _ in range(3):  # the flow plans several times (each option, then the summary): said once
            plan = reshard_plan(ckpts, layout)
            assert plan is not None and plan.step == 4
    said = [r.getMessage() for r in caplog.records if "planning skips" in r.getMessage()]
    assert len(said) == 4, said
    assert "outside the store" in said[0] and "20" in said[0]
    assert "rng/rank00009/cpu" in said[1] and "larger than any tensor" in said[1]
    assert "float32[1000000, 1000000]" in said[2]
    assert "model/b is float32[10], this job's is float32[6]" in said[3]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="parashift.checkpoint"):
        restored = restore_latest(ckpts, layout, 0)
    assert restored is not None and restored.step == 4
    refused = [r.getMessage() for r in caplog.records if "refused the checkpoint" in r.getMessage()]
    assert [m.split(":")[0] for m in refused] == [f"refused the checkpoint at step {s}" for s in (20, 16, 12, 8)]


# ---------------------------------------------------------------------------------- step folders


def test_a_link_left_in_a_step_folder_does_not_block_the_next_save(tmp_path: Path) -> None:
    store = file_store(tmp_path)
    ckpts = CheckpointStore(store, JOB)
    save(ckpts, [4])
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"not yours")
    root = tmp_path / "store" / ckpts.paths.ckpt_root
    (root / "00000008").mkdir()
    (root / "00000008" / "rank00000.bin").symlink_to(secret)  # a hostile link where the save writes
    (root / "00000012").symlink_to(tmp_path, target_is_directory=True)  # a whole step folder, linked out
    assert ckpts.uncommitted_steps() == [8, 12]
    save(ckpts, [8, 12], resumed_from=ckpts.load_manifest(4))
    assert secret.read_bytes() == b"not yours"  # never written through
    assert ckpts.committed_steps() == [4, 8, 12] and ckpts.uncommitted_steps() == []
    ckpts.verify(8)
    ckpts.verify(12)
    aside = sorted(p.name for p in root.iterdir() if ".aside-" in p.name)
    assert [a.split(".")[0] for a in aside] == ["00000008", "00000012"]
    assert (root / aside[0] / "rank00000.bin").is_symlink() and (root / aside[1]).is_symlink()
    restored = restore_latest(ckpts, layout_of(), 0)
    assert restored is not None and restored.step == 12
    save(ckpts, [16, 20], keep=1, resumed_from=restored.manifest)  # pruning takes the folders set aside with their steps
    assert sorted(p.name for p in root.iterdir()) == ["00000020"]
    assert secret.read_bytes() == b"not yours" and tmp_path.is_dir()


def _contents(store: ObjectStore) -> dict[str, bytes]:
    return {key: store.get(key) for key in store.list()}


def test_an_abandoned_save_changes_nothing_once_abandon_returns(store: ObjectStore,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Training failed with a save in flight (a warm worker then serves the job's recovery,
    which may save the same step again): after `abandon`, the old save's thread neither
    finishes its object nor commits, so nothing of it can replace what the recovery writes."""
    ckpts = CheckpointStore(store, JOB)
    save(ckpts, [4])
    first_part, go_on = threading.Event(), threading.Event()
    put_stream = store.backend.put_stream

    def paused_after_the_first_part(path: str, parts: Any) -> int:
        def paused() -> Iterator[Any]:
            for i, part in enumerate(parts):
                yield part
                if i == 0:
                    first_part.set()
                    go_on.wait(60)
        return put_stream(path, paused())

    monkeypatch.setattr(store.backend, "put_stream", paused_after_the_first_part)
    saver = Checkpointer(ckpts, layout_of(), 0, keep=10, resumed_from=ckpts.load_manifest(4))
    saver.save(8, state_of(seed=8.0), {"samples_consumed": 64}, {}, {})
    assert first_part.wait(30)
    stopped: list[bool] = []
    abandoning = threading.Thread(target=lambda: stopped.append(saver.abandon(timeout_s=60)))
    abandoning.start()
    deadline = time.monotonic() + 10
    while not saver._abandoned.is_set() and time.monotonic() < deadline:
        time.sleep(0.01)
    go_on.set()  # the write goes on: its next chunk finds the save abandoned
    abandoning.join(60)
    assert stopped == [True]
    after = _contents(store)
    assert ckpts.paths.rank_object(8, 0) not in after and ckpts.committed_steps() == [4]
    time.sleep(0.3)  # nothing lands later either
    assert _contents(store) == after
    monkeypatch.undo()
    save(ckpts, [8], resumed_from=ckpts.load_manifest(4))  # the recovery saves step 8 again
    ckpts.verify(8)
    assert ckpts.committed_steps() == [4, 8]


def test_abandon_does_not_wait_for_a_peer_that_hangs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The save thread waits in the broadcast after the set-aside (a peer hangs there): no
    storage change is under way, so `abandon` returns at once, and when the broadcast returns
    the save writes nothing."""
    from parashift.trainer.checkpoint import saver as saver_module

    store = file_store(tmp_path)
    ckpts = CheckpointStore(store, JOB)
    save(ckpts, [4])
    waiting, peer_back = threading.Event(), threading.Event()
    broadcast = saver_module.broadcast

    def hung_peer(value: Any, group: Any) -> Any:
        waiting.set()
        peer_back.wait(60)
        return broadcast(value, group)

    monkeypatch.setattr(saver_module, "broadcast", hung_peer)
    saver = Checkpointer(ckpts, layout_of(), 0, keep=10, resumed_from=ckpts.load_manifest(4))
    saver.save(8, state_of(seed=8.0), {"samples_consumed": 64}, {}, {})
    assert waiting.wait(30)
    started = time.monotonic()
    assert saver.abandon(timeout_s=30)
    assert time.monotonic() - started < 5
    before = _contents(store)
    peer_back.set()
    time.sleep(0.5)
    assert _contents(store) == before and ckpts.committed_steps() == [4]


def test_a_refused_checkpoint_is_set_aside_on_s3(s3_endpoint: str, s3_bucket: str) -> None:
    ckpts = CheckpointStore(s3_store(s3_endpoint, s3_bucket), f"{JOB}-{uuid.uuid4().hex[:6]}")
    save(ckpts, [4, 8])
    key = ckpts.paths.rank_object(8, 0)
    raw = bytearray(ckpts.store.get(key))
    raw[3] ^= 0xFF
    ckpts.store.put(key, bytes(raw))
    restored = restore_latest(ckpts, layout_of(), 0)
    assert restored is not None and restored.step == 4
    save(ckpts, [8], resumed_from=restored.manifest)
    ckpts.verify(8)
    aside = [k for k in ckpts.store.list(ckpts.paths.ckpt_root) if ".aside-" in k]
    assert sorted(k.rsplit("/", 1)[1] for k in aside) == ["manifest.json", "rank00000.bin"]
    assert ckpts.committed_steps() == [4, 8] and ckpts.uncommitted_steps() == []


@pytest.mark.slow
def test_a_replace_whose_lock_a_paused_writer_holds_gives_up_as_a_conflict(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A writer paused in the middle of a replace keeps the object's lock: a replace waiting on it
    fails as a write conflict (a lease take-over retries, then says so) instead of waiting forever."""
    import fcntl

    from parashift.storage import backends

    store = file_store(tmp_path)
    tag = store.create("jobs/x/lease.json", b"first")
    monkeypatch.setattr(backends, "LOCK_WAIT_S", 0.3)
    with open(tmp_path / "store/jobs/x/lease.json", "rb") as paused:
        fcntl.flock(paused.fileno(), fcntl.LOCK_EX)
        started = time.monotonic()
        with pytest.raises(WriteConflict, match="held its lock"):
            store.replace("jobs/x/lease.json", b"second", tag)
        assert time.monotonic() - started < 5
    store.replace("jobs/x/lease.json", b"second", tag)  # released: the replace goes through
    assert store.get("jobs/x/lease.json") == b"second"


def renewing(lease_file: Path) -> bool:
    """Whether a writer holds the lease file's lock (in the middle of a renewal)."""
    import fcntl

    with open(lease_file, "rb") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f.fileno(), fcntl.LOCK_UN)
        return False


def test_a_paused_writer_whose_lease_was_taken_cannot_commit(tmp_path: Path) -> None:
    """A run and its workers are paused (SIGSTOP) past the lease's expiry, as a host that
    freezes would be; another run takes the lease over; the paused ones continue (SIGCONT):
    the workers' next commit is refused, naming the run that holds the job now, and nothing of
    theirs is committed after the takeover."""
    import signal
    import subprocess
    import sys

    from jobs import tiny_spec
    from parashift.launcher.launch import launch_workers
    from parashift.specs.plan import Plan
    from parashift.trainer.events import CheckpointEvent, StartEvent

    spec = tiny_spec("paused", f"file://{tmp_path}/store", training={"steps": 400, "checkpoint_every": 4})
    store = file_store(tmp_path)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from parashift.storage import ObjectStore; from parashift.storage.lease import JobLease\n"
         "lease = JobLease(ObjectStore(sys.argv[1]), 'paused', ttl_s=1.5)\n"
         "with lease.hold() as token:\n    print(token, flush=True); time.sleep(600)", store.url],
        stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[1])
    try:
        token = holder.stdout.readline().strip()  # type: ignore[union-attr]
        workers: list[int] = []
        taken: list[str] = []
        before: list[int] = []
        lines: list[str] = []

        def on_event(event: object) -> None:
            if isinstance(event, StartEvent):
                workers.extend(event.pids)
            if isinstance(event, CheckpointEvent) and not taken:
                paused = [holder.pid, *workers]
                for pid in paused:
                    os.kill(pid, signal.SIGSTOP)
                try:
                    while renewing(tmp_path / "store/jobs/paused/lease.json"):  # paused holding the lease's lock
                        os.kill(holder.pid, signal.SIGCONT)
                        time.sleep(0.01)
                        os.kill(holder.pid, signal.SIGSTOP)
                    time.sleep(2.0)  # past the 1.5 s TTL: nobody renews
                    taken.append(JobLease(store, "paused").acquire().run_id)
                    before.extend(CheckpointStore(store, "paused").committed_steps())
                finally:
                    for pid in paused:
                        os.kill(pid, signal.SIGCONT)

        result = launch_workers(spec, Plan.data_parallel(2), on_line=lines.append, on_event=on_event,
                                extra_env={LEASE_ENV: token})
    finally:
        holder.kill()
        holder.wait()
    output = "\n".join(lines)
    assert taken and result.returncode != 0, output[-3000:]
    refusals = [line for line in lines if "not committed" in line and "LeaseLost" in line]
    assert refusals and "is no longer the job's" in refusals[0] and taken[0] in refusals[0], output[-3000:]
    assert CheckpointStore(store, "paused").committed_steps() == before


@pytest.mark.slow
def test_a_damaged_newest_checkpoint_is_passed_over_and_the_job_ends_as_an_undamaged_one(tmp_path: Path) -> None:
    """A job committed 4 and 8; then 12 is another model's (wider) checkpoint of the same job
    name and 16 declares a float32[10^6, 10^6] weight, both with valid digests. The plan before
    the launch and the workers both take 8, the job trains to the end past the refused steps,
    and its final state is, bit for bit, that of the same job never damaged."""
    from jobs import assert_bitwise_equal, final_state, run, tiny_spec
    from parashift.specs.plan import Plan
    from parashift.tasks.reshard import job_reshard_plan

    training = {"steps": 20, "checkpoint_every": 4, "keep_checkpoints": 5}
    spec = tiny_spec("damaged", f"file://{tmp_path}/store", training=training)
    run(spec, Plan.data_parallel(2), until_step=8)
    wider = tiny_spec("damaged", f"file://{tmp_path}/other", training=training, model={"d_model": 48})
    run(wider, Plan.data_parallel(2), until_step=12)
    shutil.copytree(tmp_path / "other/jobs/damaged/ckpt/00000012", tmp_path / "store/jobs/damaged/ckpt/00000012")
    ckpts = CheckpointStore(file_store(tmp_path), "damaged")
    huge = json.loads(ckpts.load_manifest(8).model_dump_json())
    weight = huge["tensors"]["model/tok_emb.weight"]
    weight["shape"] = [10**6, 10**6]
    _forge(ckpts, 16, huge)
    assert ckpts.committed_steps() == [4, 8, 12, 16]  # every manifest parses: the damage is in what they say
    planned = job_reshard_plan(spec, Plan.data_parallel(2))
    assert planned is not None and planned.step == 8
    resumed = run(spec, Plan.data_parallel(2))
    assert resumed.start is not None and resumed.start.step == 8 and resumed.final_step == 20
    clean = tiny_spec("clean", f"file://{tmp_path}/store", training=training)
    run(clean, Plan.data_parallel(2))
    assert_bitwise_equal(final_state(spec), final_state(clean))
