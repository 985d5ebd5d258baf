"""Contract tests for storage/: the same suite on both backends, local files (file://) and
fsspec (memory://, and s3:// on a local S3: moto's server).

Malformed manifests: `committed_steps`/`latest` skip them (with a warning; the step counts as
uncommitted) and `load_manifest` on that step raises MalformedManifest, a StorageError.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import uuid
from collections.abc import Iterator

import pytest
from parashift.storage import (
    CheckpointNotFound,
    CheckpointStore,
    ChecksumMismatch,
    JobPaths,
    MalformedManifest,
    Manifest,
    ObjectNotFound,
    ObjectRecord,
    ObjectStore,
    SliceKey,
    SlicePayload,
    StorageError,
    StoragePermissionError,
    TensorRecord,
    TransientStorageError,
    is_pending_manifest,
    is_transient,
    job_key,
    translate_error,
)
from parashift.storage.backends import Backend, FsspecObjects, LocalFiles, MemoryObjects, S3Objects
from pydantic import ValidationError

# Each URL scheme of the suite, and the backend implementation that serves it.
BACKENDS = {"file": LocalFiles, "memory": MemoryObjects, "s3": S3Objects}


@pytest.fixture(params=list(BACKENDS))
def store(request: pytest.FixtureRequest, tmp_path) -> Iterator[ObjectStore]:
    """A fresh, empty ObjectStore on each backend."""
    if request.param == "file":
        s = ObjectStore(f"file://{tmp_path}/store")
    elif request.param == "memory":
        s = ObjectStore(f"memory://parashift-test-{uuid.uuid4().hex[:12]}")
    else:
        endpoint = request.getfixturevalue("s3_endpoint")
        bucket = request.getfixturevalue("s3_bucket")
        s = ObjectStore(f"s3://{bucket}/root", {"endpoint_url": endpoint})
    assert type(s.backend) is BACKENDS[request.param]
    yield s
    if request.param == "memory" and s.fs.exists(s._root):  # the memory filesystem is process-global
        s.fs.rm(s._root, recursive=True)


def _twin(store: ObjectStore) -> ObjectStore:
    """A second, independent store on the same URL: writes through it are 'behind the back'."""
    opts = {"endpoint_url": store.fs.endpoint_url} if store.protocol == "s3" else None
    return ObjectStore(store.url, opts)


# ---------------------------------------------------------------------------------- bytes


def test_put_get_roundtrip(store: ObjectStore) -> None:
    payload = bytes(range(256)) * 10
    store.put("a/b/blob.bin", payload)
    store.put("empty", b"")
    assert store.get("a/b/blob.bin") == payload
    assert store.get("empty") == b""
    assert store.stats.put_requests == 2
    assert store.stats.bytes_written == len(payload)
    assert store.stats.as_dict() == {
        "bytes_read": len(payload),
        "bytes_written": len(payload),
        "get_requests": 2,
        "put_requests": 2,
    }
    assert store.url_for("a/b/blob.bin") == store.url + "/a/b/blob.bin"


def test_ranged_get(store: ObjectStore) -> None:
    payload = bytes(range(200))
    store.put("r", payload)
    before = store.stats.bytes_read
    assert store.get("r", 10, 20) == payload[10:20]
    assert store.stats.bytes_read - before == 10
    assert store.get("r", 190) == payload[190:]
    assert store.get("r", None, 5) == payload[:5]
    assert store.get("r", 50, 50) == b""


def test_get_ranges(store: ObjectStore) -> None:
    store.put("x", b"0123456789")
    store.put("y/z", b"abcdefghij")
    gets = store.stats.get_requests
    out = store.get_ranges([("y/z", 2, 4), ("x", 0, 3), ("x", 7, 10), ("y/z", 9, 10)])
    assert out == [b"cd", b"012", b"789", b"j"]
    assert store.stats.get_requests - gets == 4
    assert store.get_ranges([]) == []


def test_read_into(store: ObjectStore) -> None:
    """Buffers that tile each request are filled in order; `then(i)` hears each request once."""
    store.put("a", bytes(range(100)))
    store.put("b/c", bytes(range(50, 150)))
    buffers = [[memoryview(bytearray(3)), memoryview(bytearray(5))], [memoryview(bytearray(10))],
               [memoryview(bytearray(0)), memoryview(bytearray(1))]]
    done: list[int] = []
    gets, read = store.stats.get_requests, store.stats.bytes_read
    store.read_into([("a", 10, buffers[0]), ("b/c", 0, buffers[1]), ("a", 99, buffers[2])], then=done.append)
    assert [b"".join(bytes(b) for b in out) for out in buffers] == [bytes(range(10, 18)), bytes(range(50, 60)), bytes([99])]
    assert sorted(done) == [0, 1, 2]
    assert store.stats.get_requests - gets == 3 and store.stats.bytes_read - read == 19
    with pytest.raises(StorageError):  # the object ends first
        store.read_into([("a", 95, [memoryview(bytearray(10))])])
    with pytest.raises(ObjectNotFound):
        store.read_into([("no/such", 0, [memoryview(bytearray(1))])])
    store.read_into([])


def test_each_backend_implements_the_protocol(tmp_path) -> None:
    """Local files for file:// and plain paths, fsspec for the rest; every primitive there."""
    primitives = [name for name in vars(Backend) if not name.startswith("_")] + list(Backend.__annotations__)
    for url, kind in [(f"file://{tmp_path}", LocalFiles), (str(tmp_path), LocalFiles),
                      ("memory://protocol-test", MemoryObjects)]:
        backend = ObjectStore(url).backend
        assert type(backend) is kind
        assert [name for name in primitives if not hasattr(backend, name)] == []
    assert issubclass(S3Objects, FsspecObjects) and issubclass(MemoryObjects, FsspecObjects)


def test_put_overwrites(store: ObjectStore) -> None:
    store.put("k", b"old" * 1000)
    store.put("k", b"new")
    assert store.get("k") == b"new"
    assert store.size("k") == 3
    assert store.list() == ["k"]  # no temporary files visible


class _SourceFailed(Exception):
    """What a streamed write's source raises part-way (a save abandoned, a bad tensor)."""


@pytest.mark.parametrize("part_bytes", [1000, 3 * 2**20], ids=["small", "multipart"])
def test_a_streamed_write_whose_source_fails_changes_nothing(store: ObjectStore, part_bytes: int) -> None:
    """Parts already sent never become an object: the old object stays, nothing else appears,
    and no upload is left open (S3 with a 5 MiB block: two parts uploaded before the failure)."""
    if store.protocol == "s3":
        store = ObjectStore(store.url, {"endpoint_url": store.fs.endpoint_url, "default_block_size": 5 * 2**20})
    store.put("d/k", b"old")

    def parts():
        for _ in range(4):
            yield b"x" * part_bytes
        raise _SourceFailed("the source failed after four parts")

    with pytest.raises(_SourceFailed):
        store.put_stream("d/k", parts)
    with pytest.raises(_SourceFailed):
        store.put_stream("d/new", parts)
    assert store.get("d/k") == b"old"
    assert store.list("d") == ["d/k"]
    if store.protocol == "s3":
        assert store.fs.list_multipart_uploads(store._root.split("/")[0]) == []
    assert store.put_stream("d/k", lambda: iter([b"new", b"er"])) == 5  # and a whole write still lands
    assert store.get("d/k") == b"newer"


def test_local_put_is_atomic(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = ObjectStore(str(tmp_path / "s"))
    store.put("d/k", b"old")

    def boom(src: str, dst: str) -> None:
        raise OSError(5, "disk on fire")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(StorageError):
        store.put("d/k", b"new")
    monkeypatch.undo()
    assert store.get("d/k") == b"old"
    assert os.listdir(tmp_path / "s" / "d") == ["k"]  # the temp file was removed



# Part sizes that straddle the O_DIRECT block and the write buffer (shrunk to 3 blocks below).
_STREAM_PARTS = [1, 4095, 4097, 3 * 4096, 3 * 4096 + 3, 5, 70_000]


@pytest.mark.parametrize("refused", ["none", "open", "write"])
def test_local_streams_are_written_past_the_page_cache_or_buffered(tmp_path, monkeypatch: pytest.MonkeyPatch,
                                                                   refused: str) -> None:
    """A local stream (a checkpoint object) is written with O_DIRECT through an aligned
    buffer, its last block padded and the file cut to size; where the filesystem refuses
    O_DIRECT at open or at a write (EINVAL), the same stream is written buffered. Either way
    the object is exactly the parts' bytes."""
    from parashift.storage import backends

    direct = getattr(os, "O_DIRECT", 0)
    if not direct:
        pytest.skip("no O_DIRECT on this platform")
    monkeypatch.setattr(backends._DirectWrites, "BUFFER", 3 * 4096)
    opened_direct, writes = [], {"direct": 0, "buffered": 0}
    real_open, real_write = os.open, os.write

    def open_(path, flags, *args):
        if flags & direct and refused == "open":
            raise OSError(errno.EINVAL, "O_DIRECT not supported")
        fd = real_open(path, flags, *args)
        opened_direct.append(bool(flags & direct))
        return fd

    def write(fd, data):
        is_direct = bool(fcntl.fcntl(fd, fcntl.F_GETFL) & direct)
        if is_direct and refused == "write":
            raise OSError(errno.EINVAL, "misaligned")
        writes["direct" if is_direct else "buffered"] += 1
        return real_write(fd, data)

    monkeypatch.setattr(backends.os, "open", open_)
    monkeypatch.setattr(backends.os, "write", write)
    parts = [os.urandom(n) for n in _STREAM_PARTS]
    store = ObjectStore(str(tmp_path / "s"))
    assert store.put_stream("d/k", lambda: iter(parts)) == sum(_STREAM_PARTS)
    assert store.get("d/k") == b"".join(parts)
    assert store.list("d") == ["d/k"]  # no temporary file left
    assert opened_direct[0] is (refused != "open")
    if refused == "none":
        assert writes["direct"] > 1 and writes["buffered"] == 0
    else:
        assert writes["direct"] == 0 and writes["buffered"] > 1


def test_list_delete_exists_size(store: ObjectStore) -> None:
    for key in ["a/b", "a/bc", "a/b2/c", "a/x/y/z", "top"]:
        store.put(key, key.encode())
    assert store.list() == ["a/b", "a/b2/c", "a/bc", "a/x/y/z", "top"]
    assert store.list("a/x") == ["a/x/y/z"]
    assert store.list("a/x/") == ["a/x/y/z"]
    assert store.list("nothing") == []
    assert store.exists("a/bc") and not store.exists("a/nope") and not store.exists("a/x")
    assert store.size("a/x/y/z") == 7
    store.delete("a/b")  # a key: must not take a/bc or a/b2/... with it
    assert store.list() == ["a/b2/c", "a/bc", "a/x/y/z", "top"]
    store.delete("a/x")  # a folder, recursively
    assert store.list() == ["a/b2/c", "a/bc", "top"]
    store.delete("missing/folder")
    store.delete("missing-key")
    with pytest.raises(ValueError):
        store.delete("")


def test_json_roundtrip(store: ObjectStore) -> None:
    doc = {"step": 3, "nested": {"x": [1, 2.5, None, "s"]}, "ok": True}
    store.put_json("meta/doc.json", doc)
    assert store.get_json("meta/doc.json") == doc
    store.put("meta/bad.json", b"\x80not json")
    with pytest.raises(StorageError, match="not valid JSON"):
        store.get_json("meta/bad.json")


def test_missing_key(store: ObjectStore) -> None:
    for call in (
        lambda: store.get("no/such"),
        lambda: store.get("no/such", 0, 4),
        lambda: store.get_ranges([("no/such", 0, 4)]),
        lambda: store.size("no/such"),
        lambda: store.get_json("no/such"),
    ):
        with pytest.raises(ObjectNotFound) as info:
            call()
        assert isinstance(info.value, FileNotFoundError)
        assert "no/such" in str(info.value)


def test_invalid_keys(store: ObjectStore) -> None:
    for bad in ["../escape", "a/../../b", "a//b", "./a"]:
        with pytest.raises(ValueError):
            store.put(bad, b"x")


def test_file_urls_resolve_against_cwd_at_construction(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    rel = ObjectStore("file://./rel")
    plain = ObjectStore("plain/dir")
    assert rel.url == f"file://{tmp_path}/rel"
    assert plain.url == f"file://{tmp_path}/plain/dir"
    rel.put("k", b"1")
    monkeypatch.chdir("/")
    assert rel.get("k") == b"1"
    assert (tmp_path / "rel" / "k").read_bytes() == b"1"


def test_s3_stores_do_not_share_instances(s3_endpoint: str, s3_bucket: str) -> None:
    a = ObjectStore(f"s3://{s3_bucket}", {"endpoint_url": s3_endpoint})
    b = ObjectStore(f"s3://{s3_bucket}/p", {"endpoint_url": s3_endpoint})
    assert a.fs is not b.fs
    b.put("k", b"v")
    assert a.list() == ["p/k"]


def test_s3_ranged_read_transfers_only_the_range(s3_endpoint: str, s3_bucket: str) -> None:
    """4 KiB out of a 4 MiB object: ~4 KiB on the wire (no 50 MiB read-ahead, no whole object)."""
    store = ObjectStore(f"s3://{s3_bucket}", {"endpoint_url": s3_endpoint})
    payload = os.urandom(4 * 2**20)
    store.put("big.bin", payload)
    wire: list[int] = []

    def on_get(parsed: dict, **_: object) -> None:
        wire.append(int(parsed.get("ContentLength", -1)))

    store.fs.s3.meta.events.register("after-call.s3.GetObject", on_get)
    store.stats.reset()
    start = 2**20 + 123
    assert store.get("big.bin", start, start + 4096) == payload[start : start + 4096]
    assert store.get_ranges([("big.bin", 0, 4096)]) == [payload[:4096]]
    assert store.stats.bytes_read == 2 * 4096
    assert store.stats.get_requests == 2
    assert wire == [4096, 4096]  # what the server actually sent, per GetObject


# ---------------------------------------------------------------------------------- checkpoints

JOB = "job-1"


def _slices(step: int, rank: int) -> list[SlicePayload]:
    """Two ranks each own half of w (4x4 float32, a chunk per row) and rank 0 also owns b (4,)."""
    rows = bytes([(step + rank + i) % 256 for i in range(32)])  # 2 rows x 4 x 4 bytes
    out = [SlicePayload.of_bytes(SliceKey("w", (2 * rank, 0), (2, 4)), (0, 1), rows, (16, 16))]
    if rank == 0:
        out.append(SlicePayload.of_bytes(SliceKey("b", (0,), (4,)), (0,), bytes([step % 256]) * 16, (16,)))
    return out


def _save(ckpts: CheckpointStore, step: int, *, commit: bool = True, world: int = 2,
          previous: int | None = None) -> Manifest:
    tensors = {
        "w": TensorRecord(name="w", dtype="float32", shape=[4, 4], slices=[]),
        "b": TensorRecord(name="b", dtype="float32", shape=[4], slices=[]),
    }
    objects = {}
    for rank in range(world):
        obj, records = ckpts.write_rank_object(step, rank, _slices(step, rank))
        assert obj is not None
        objects[obj.key] = obj
        for r in records:
            tensors[r.tensor].slices.append(r)
    manifest = Manifest(
        job_id=ckpts.job_id,
        step=step,
        world_size=world,
        data_position={"epoch": 0, "sample": step * 8},
        plan={"mesh": [world], "placements": {}},
        tensors=tensors,
        objects=objects,
        previous_step=previous,
    )
    if commit:
        ckpts.commit(manifest)
    return manifest


def test_checkpoint_write_commit_latest(store: ObjectStore) -> None:
    ckpts = CheckpointStore(store, JOB)
    assert ckpts.latest() is None and ckpts.committed_steps() == []
    puts = store.stats.put_requests
    obj, records = ckpts.write_rank_object(7, 0, _slices(7, 0))
    assert store.stats.put_requests - puts == 1  # one PUT per rank object
    assert obj is not None and obj.key == "rank00000.bin" and obj.nbytes == 48
    assert [(r.byte_offset, r.nbytes) for r in records] == [(0, 32), (32, 16)]
    assert ckpts.write_rank_object(7, 1, []) == (None, [])
    assert not store.exists(JobPaths(JOB).rank_object(7, 1))

    m10 = _save(ckpts, 10)
    url = ckpts.commit(m10)  # re-committing the same manifest is harmless
    assert url == store.url_for("jobs/job-1/ckpt/00000010/manifest.json")
    _save(ckpts, 30)
    assert ckpts.committed_steps() == [10, 30]
    latest = ckpts.latest()
    assert latest is not None and latest.step == 30
    assert ckpts.load_manifest(10) == m10

    records = latest.tensors["w"].slices
    assert ckpts.read_slices(30, records) == [bytes(p.chunk(0)) + bytes(p.chunk(1)) for r in (0, 1) for p in _slices(30, r)[:1]]
    ckpts.verify(30)


def test_uncommitted_checkpoint_is_invisible(store: ObjectStore) -> None:
    ckpts = CheckpointStore(store, JOB)
    _save(ckpts, 10)
    _save(ckpts, 20, commit=False)
    assert store.exists("jobs/job-1/ckpt/00000020/rank00000.bin")
    assert ckpts.committed_steps() == [10]
    latest = ckpts.latest()
    assert latest is not None and latest.step == 10
    with pytest.raises(CheckpointNotFound):
        ckpts.load_manifest(20)
    with pytest.raises(CheckpointNotFound):
        ckpts.verify(20)


def test_commit_refuses_missing_or_short_objects(store: ObjectStore) -> None:
    ckpts = CheckpointStore(store, JOB)
    manifest = _save(ckpts, 5, commit=False)
    store.delete(JobPaths(JOB).rank_object(5, 1))
    with pytest.raises(StorageError, match="missing"):
        ckpts.commit(manifest)
    store.put(JobPaths(JOB).rank_object(5, 1), b"short")
    with pytest.raises(StorageError, match="bytes"):
        ckpts.commit(manifest)
    assert not store.exists(JobPaths(JOB).manifest(5))
    with pytest.raises(ValueError):
        CheckpointStore(store, "other-job").commit(manifest)


def test_corrupted_slice_is_detected(store: ObjectStore) -> None:
    ckpts = CheckpointStore(store, JOB)
    manifest = _save(ckpts, 10)
    key = JobPaths(JOB).rank_object(10, 1)
    raw = bytearray(store.get(key))
    raw[5] ^= 0xFF
    _twin(store).put(key, bytes(raw))  # behind the CheckpointStore's back

    bad = [r for r in manifest.tensors["w"].slices if r.object == "rank00001.bin"]
    with pytest.raises(ChecksumMismatch) as info:
        ckpts.read_slices(10, bad)
    msg = str(info.value)
    assert key in msg and "[0, 16)" in msg and f"{bad[0].chunks[0][1]:08x}" in msg and info.value.actual in msg
    good = [r for r in manifest.all_slices() if r.object == "rank00000.bin"]
    assert len(ckpts.read_slices(10, good)) == 2
    with pytest.raises(ChecksumMismatch):
        ckpts.verify(10)


def test_prune(store: ObjectStore) -> None:
    ckpts = CheckpointStore(store, JOB)
    _save(ckpts, 5, commit=False)
    assert ckpts.prune(keep=1) == []  # nothing is deleted before something is committed
    _save(ckpts, 10)
    _save(ckpts, 20, commit=False)  # a crashed save
    _save(ckpts, 30, previous=10)
    _save(ckpts, 40, commit=False)  # a save in progress, newer than anything committed
    assert ckpts.prune(keep=2) == [5, 20]
    assert ckpts.committed_steps() == [10, 30]
    assert ckpts.prune(keep=1) == [10]
    assert ckpts.committed_steps() == [30]
    steps = {k.split("/")[3] for k in store.list("jobs/job-1/ckpt")}
    assert steps == {"00000030", "00000040"}
    ckpts.verify(30)
    assert ckpts.prune(keep=1) == []
    with pytest.raises(ValueError):
        ckpts.prune(keep=0)


def test_a_pending_manifest_is_no_checkpoint_and_goes_once_its_step_commits(store: ObjectStore) -> None:
    """A step warm workers hold at a planned change: its records (computed from memory, nothing
    written) are those the save writes later; its pending manifest is invisible to every
    listing of checkpoints, and pruning removes it once that step (or a newer) commits."""
    ckpts = CheckpointStore(store, JOB)
    _save(ckpts, 10)
    puts = store.stats.put_requests
    pending = [ckpts.pending_records(rank, _slices(20, rank)) for rank in range(2)]
    assert store.stats.put_requests == puts, "records without a write"
    held = Manifest(job_id=JOB, step=20, world_size=2, data_position={"epoch": 0, "sample": 160},
                    plan={"mesh": [2], "placements": {}}, previous_step=10,
                    objects={o.key: o for o, _ in pending if o is not None},
                    tensors={name: TensorRecord(name=name, dtype="float32", shape=shape,
                                                slices=[r for _, rs in pending for r in rs if r.tensor == name])
                             for name, shape in (("w", [4, 4]), ("b", [4]))})
    url = ckpts.write_pending(held)
    assert url.endswith("jobs/job-1/ckpt/pending/00000020.json") and is_pending_manifest(url)
    assert not is_pending_manifest(store.url_for(JobPaths(JOB).manifest(20)))
    assert ckpts.pending_steps() == [20]
    assert ckpts.manifest_steps() == [10] and ckpts.uncommitted_steps() == [] and ckpts.latest().step == 10
    assert ckpts.parse_manifest(20, ckpts.read_pending_bytes(20)).tensors == held.tensors
    with pytest.raises(CheckpointNotFound):
        ckpts.read_pending_bytes(30)
    assert ckpts.prune(keep=2) == [] and ckpts.pending_steps() == [20]  # step 10 is the newest commit
    saved = _save(ckpts, 20, previous=10)  # that step saved after all
    assert saved.tensors == held.tensors and saved.objects == held.objects, "the same records, written"
    assert ckpts.prune(keep=2) == [] and ckpts.pending_steps() == []
    assert ckpts.committed_steps() == [10, 20]


def test_refused_checkpoints_never_push_a_good_one_out(store: ObjectStore) -> None:
    """Steps 10 and 15 were refused (say, by their checksums) and training went on from step 0:
    its new step-5 checkpoint is the one to keep, whatever stands above it; once the new
    lineage has `keep` checkpoints, what lies below them goes."""
    ckpts = CheckpointStore(store, JOB)
    _save(ckpts, 10)
    _save(ckpts, 15, previous=10)
    _save(ckpts, 5)  # trained again from step 0: previous None
    assert ckpts.prune(keep=2, newest=5) == []
    assert ckpts.committed_steps() == [5, 10, 15]
    _save(ckpts, 8, previous=5)
    _save(ckpts, 12, previous=8)  # the refused step 10 lies between: not counted, not yet deleted
    assert ckpts.lineage(12, 2) == [12, 8]
    assert ckpts.prune(keep=2, newest=12) == [5]
    assert ckpts.committed_steps() == [8, 10, 12, 15]
    _save(ckpts, 16, previous=12)
    assert ckpts.prune(keep=2, newest=16) == [8, 10]
    _save(ckpts, 20, previous=16)
    assert ckpts.prune(keep=2, newest=20) == [12, 15]
    assert ckpts.committed_steps() == [16, 20]


def test_a_step_folder_without_manifest_is_listed(store: ObjectStore) -> None:
    ckpts = CheckpointStore(store, JOB)
    _save(ckpts, 10)
    _save(ckpts, 20, previous=10)
    store.delete(JobPaths(JOB).manifest(20))
    assert ckpts.uncommitted_steps() == [20] and ckpts.committed_steps() == [10]


def test_object_names_stay_in_the_checkpoint_folder() -> None:
    for bad in ["../rank00000.bin", "/etc/passwd", "a/b.bin", "..", ".hidden", "manifest.json", "x" * 200, ""]:
        with pytest.raises(ValueError, match="plain file name"):
            ObjectRecord(key=bad, nbytes=1)
    ObjectRecord(key="rank00007.bin", nbytes=1)


def test_local_store_refuses_links_out_of_it(tmp_path) -> None:
    root = tmp_path / "store"
    store = ObjectStore(f"file://{root}")
    store.put("jobs/a/inside.bin", b"inside")
    outside = tmp_path / "secret.bin"
    outside.write_bytes(b"secret")
    (root / "jobs/a/link-out.bin").symlink_to(outside)
    (root / "jobs/a/link-in.bin").symlink_to(root / "jobs/a/inside.bin")
    (root / "jobs/b").symlink_to(tmp_path, target_is_directory=True)
    assert store.get("jobs/a/link-in.bin") == b"inside"  # a link that stays inside is fine
    for key in ["jobs/a/link-out.bin", "jobs/b/secret.bin"]:
        with pytest.raises(StorageError, match="outside the store"):
            store.get(key)
        with pytest.raises(StorageError, match="outside the store"):
            store.read_into([(key, 0, [memoryview(bytearray(3))])])


def test_malformed_manifest_is_skipped(store: ObjectStore, caplog: pytest.LogCaptureFixture) -> None:
    ckpts = CheckpointStore(store, JOB)
    _save(ckpts, 10)
    _save(ckpts, 20, commit=False)
    store.put(JobPaths(JOB).manifest(20), b'{"format_version": 1, "job_id": "job-1"')
    _save(ckpts, 30, commit=False)
    store.put_json(JobPaths(JOB).manifest(30), {"job_id": JOB, "step": 30, "surprise": 1})
    with caplog.at_level(logging.WARNING, logger="parashift.storage"):
        assert ckpts.committed_steps() == [10]
        latest = ckpts.latest()
    assert latest is not None and latest.step == 10
    assert "skipping step 30" in caplog.text
    for step in (20, 30):
        with pytest.raises(MalformedManifest) as info:
            ckpts.load_manifest(step)
        assert isinstance(info.value, StorageError)


def test_job_paths() -> None:
    p = JobPaths("j")
    assert p.manifest(12) == "jobs/j/ckpt/00000012/manifest.json"
    assert p.rank_object(12, 3) == "jobs/j/ckpt/00000012/rank00003.bin"
    assert p.event(4) == "jobs/j/events/000004.json"
    assert p.profile("abc") == "jobs/j/profile/abc.json"
    assert p.stop() == "jobs/j/control/stop.json"
    assert job_key("j", "a", "b.json") == p.job_key("a", "b.json") == "jobs/j/a/b.json"
    with pytest.raises(ValueError):
        JobPaths("a/b")


def test_manifest_rejects_unknown_fields_and_dangling_slices() -> None:
    with pytest.raises(ValidationError):
        Manifest.model_validate(
            {"job_id": "j", "step": 1, "world_size": 1, "data_position": {}, "plan": {}, "tensors": {}}
            | {"objects": {}, "extra": 1}
        )
    slice_ = {"tensor": "t", "offsets": [0], "lengths": [1], "object": "rank00000.bin"}
    slice_ |= {"byte_offset": 0, "nbytes": 4, "dim_order": [0], "chunks": [[4, 0]]}
    with pytest.raises(ValidationError, match="unknown object"):
        Manifest.model_validate(
            {"job_id": "j", "step": 1, "world_size": 1, "data_position": {}, "plan": {}, "objects": {}}
            | {"tensors": {"t": {"name": "t", "dtype": "float32", "shape": [1], "slices": [slice_]}}}
        )


# ---------------------------------------------------------------------------------- error table


def _client_error(code: str, status: int = 400):
    from botocore.exceptions import ClientError

    response = {
        "Error": {"Code": code, "Message": f"{code} happened"},
        "ResponseMetadata": {"HTTPStatusCode": status},
    }
    return ClientError(response, "GetObject")


@pytest.mark.parametrize(
    ("code", "status", "expected", "transient"),
    [
        ("NoSuchKey", 404, ObjectNotFound, False),
        ("404", 404, ObjectNotFound, False),
        ("403", 403, StoragePermissionError, False),
        ("AccessDenied", 403, StoragePermissionError, False),
        ("SlowDown", 503, TransientStorageError, True),
        ("500", 500, TransientStorageError, True),
        ("InternalError", 500, TransientStorageError, True),
        ("503", 503, TransientStorageError, True),
        ("SomethingNew", 418, StorageError, False),
        ("SomethingNew", 502, TransientStorageError, True),  # unknown code, known status
    ],
)
def test_error_table_client_errors(code: str, status: int, expected: type, transient: bool) -> None:
    err = _client_error(code, status)
    out = translate_error(err, "get s3://b/k")
    assert type(out) is expected
    assert is_transient(err) is transient
    assert "get s3://b/k" in str(out)
    # s3fs hands us an OSError translated from the ClientError, with the ClientError as cause.
    wrapped = OSError(16, "translated by s3fs")
    wrapped.__cause__ = err
    assert type(translate_error(wrapped)) is expected
    assert is_transient(wrapped) is transient


def test_error_table_builtins_and_transport() -> None:
    from botocore.exceptions import EndpointConnectionError

    assert isinstance(translate_error(FileNotFoundError(2, "x")), ObjectNotFound)
    assert isinstance(translate_error(PermissionError(13, "x")), PermissionError)
    assert is_transient(ConnectionResetError(104, "reset"))
    assert is_transient(TimeoutError())
    assert is_transient(EndpointConnectionError(endpoint_url="http://x"))
    assert type(translate_error(EndpointConnectionError(endpoint_url="http://x"))) is TransientStorageError
    assert type(translate_error(OSError(5, "io"))) is StorageError
    not_backend = ValueError("a bug, not a backend error")
    assert translate_error(not_backend) is not_backend
    assert isinstance(ObjectNotFound("k"), FileNotFoundError)


def test_call_retries_only_idempotent_transient_errors(caplog: pytest.LogCaptureFixture) -> None:
    store = ObjectStore("memory://retry-test", backoff_s=0.001)
    attempts: list[int] = []

    def flaky() -> str:
        attempts.append(1)
        if len(attempts) < 3:
            raise _client_error("SlowDown", 503)
        return "ok"

    with caplog.at_level(logging.WARNING, logger="parashift.storage"):
        assert store._call("get", "k", flaky) == "ok"
    assert len(attempts) == 3 and caplog.text.count("retrying") == 2

    attempts.clear()
    with pytest.raises(TransientStorageError) as info:
        store._call("post", "k", flaky, idempotent=False)
    assert len(attempts) == 1 and info.value.__cause__ is not None

    def always_slow() -> None:
        attempts.append(1)
        raise _client_error("SlowDown", 503)

    attempts.clear()
    with pytest.raises(TransientStorageError):
        store._call("get", "k", always_slow)
    assert len(attempts) == 4  # max 4 tries

    def missing() -> None:
        attempts.append(1)
        raise _client_error("NoSuchKey", 404)

    attempts.clear()
    with pytest.raises(ObjectNotFound):
        store._call("get", "k", missing)
    assert len(attempts) == 1
