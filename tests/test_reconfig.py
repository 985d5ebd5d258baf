"""ReconfigPlans without processes: for every pair among a set of plans, each new rank's reads
are exactly the bytes it needs (no chunk-edge overhead for degrees up to 8), and executing them
through real storage gives, element for element, the slice of the global tensor."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from parashift.models.gpt.spec import GPTSpec
from parashift.ptc import Layout
from parashift.ptc.chunks import chunk_rows, split_points, storage_order
from parashift.ptc.layout import Slice
from parashift.specs.plan import Plan
from parashift.storage import CheckpointStore, JobLease, ObjectStore
from parashift.storage.manifest import manifest_digest
from parashift.trainer.checkpoint import execute_reads, reads_for, reshard_plan
from parashift.trainer.layout import state_layout
from states import box_of, global_state, save_all_ranks

# Uneven on purpose: vocab 250 and d_model 60 do not split evenly 3, 4 or 8 ways.
CONFIG = GPTSpec(n_layers=2, d_model=60, n_heads=6, vocab_size=250, seq_len=24)

PLANS = {
    "dp1": Plan(devices=1, mesh={}),
    "dp2": Plan.data_parallel(2),
    "dp3": Plan.data_parallel(3),
    "tp2": Plan(devices=2, mesh={"tp": 2}),
    "tp3": Plan(devices=3, mesh={"tp": 3}),
    "tp4": Plan(devices=4, mesh={"tp": 4}),
    "dp2xtp2": Plan(devices=4, mesh={"dp": 2, "tp": 2}),
    "pp2xdp2": Plan(devices=4, mesh={"pp": 2, "dp": 2}),
    "pp2xtp2": Plan(devices=4, mesh={"pp": 2, "tp": 2}),
    "dp4": Plan.data_parallel(4),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[CheckpointStore, Layout, dict[str, torch.Tensor]]]:
    out = {}
    for name, plan in PLANS.items():
        layout = state_layout(plan, CONFIG)
        store = CheckpointStore(ObjectStore(f"file://{tmp_path_factory.mktemp(name)}"), "job")
        state = global_state(layout)
        save_all_ranks(store, layout, state, step=3)
        out[name] = (store, layout, state)
    return out


def assert_every_byte_checked_once(reads) -> None:
    """Each request's chunk checks tile its bytes: every byte read is verified, by one chunk."""
    for request in reads.requests:
        at = 0
        for offset, n, _ in sorted(request.checks):
            assert offset == at and n > 0, (request.object, request.start, offset, at)
            at += n
        assert at == request.nbytes, (request.object, at, request.nbytes)


@pytest.mark.parametrize("old,new", list(itertools.permutations(PLANS, 2)))
def test_reshard_reads_exactly_the_needed_bytes_and_equals_the_slices(saved, old: str, new: str) -> None:
    store, _, state = saved[old]
    layout = state_layout(PLANS[new], CONFIG)
    plan = reshard_plan(store, layout)
    assert plan is not None and plan.step == 3
    totals = plan.totals()
    assert totals["bytes_read"] == totals["bytes_needed"] > 0
    manifest = store.latest()
    for reads in plan.ranks:
        assert_every_byte_checked_once(reads)
        got = execute_reads(store, 3, reads)
        assert got.keys() == reads.wanted.keys()
        for name, box in reads.wanted.items():
            assert torch.equal(got[name], box_of(state[name], box)), (name, box)
        wanted_model = {n for n in layout.boxes_of(reads.rank) if n.startswith(("model/", "optim/"))}
        assert wanted_model <= got.keys()
    # Reads that touch in one object are one request: never more requests than stored slices read.
    for reads in plan.ranks:
        touched = {(p.source.object, p.source.byte_offset) for r in reads.requests for p in r.pieces}
        assert len(reads.requests) <= len(touched)
    assert manifest is not None


def test_whole_tensor_restore_is_few_requests(saved) -> None:
    """dp2 -> dp3: every rank reads every tensor whole from two objects: a couple of requests."""
    store, _, _ = saved["dp2"]
    plan = reshard_plan(store, state_layout(PLANS["dp3"], CONFIG))
    assert plan is not None
    assert all(len(r.requests) <= 3 for r in plan.ranks)  # 2 objects (+ its own RNG state)


def test_chunk_edges_include_every_split_point() -> None:
    shape, itemsize = (250, 60), 4
    box = Slice((0, 0), shape)
    rows = chunk_rows(shape, box, storage_order(2, 0), itemsize, 0)
    edges = set(itertools.accumulate(rows))
    assert split_points(250) <= edges and sum(rows) == 250


def test_a_corrupted_chunk_is_detected_and_never_loaded(saved, tmp_path) -> None:
    import shutil

    from parashift.storage import ChecksumMismatch

    store, _, _ = saved["tp2"]
    root = store.store.url.removeprefix("file://")
    copy = tmp_path / "copy"
    shutil.copytree(root, copy)
    twin = CheckpointStore(ObjectStore(f"file://{copy}"), "job")
    path = copy / "jobs/job/ckpt/00000003/rank00001.bin"
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    path.write_bytes(bytes(raw))
    plan = reshard_plan(twin, state_layout(PLANS["dp2"], CONFIG))
    assert plan is not None
    with pytest.raises(ChecksumMismatch):
        for reads in plan.ranks:
            execute_reads(twin, 3, reads)


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_any_box_reads_back_exactly_even_off_the_chunk_grid(saved, data: st.DataObject) -> None:
    """Boxes no plan makes (cut across inner dims, off every split point) still come back
    element for element, through widened chunk reads and scratch buffers."""
    old = data.draw(st.sampled_from(["tp2", "dp2xtp2", "pp2xtp2", "tp3"]))
    store, layout, state = saved[old]
    manifest = store.latest()
    assert manifest is not None
    names = sorted(n for n, t in layout.tensors.items() if len(t.shape) == 2)
    name = data.draw(st.sampled_from(names))
    shape = layout.tensors[name].shape
    offsets = tuple(data.draw(st.integers(0, n - 1)) for n in shape)
    lengths = tuple(data.draw(st.integers(1, n - o)) for n, o in zip(shape, offsets, strict=True))
    box = Slice(offsets, lengths)
    reads = reads_for(manifest, {name: box}, 0)
    assert reads.bytes_read >= reads.bytes_needed
    assert_every_byte_checked_once(reads)
    got = execute_reads(store, manifest.step, reads)
    assert torch.equal(got[name], box_of(state[name], box))


def test_reshard_plan_command_shows_the_moves_before_anything_starts(tmp_path) -> None:
    """`parashift reshard-plan`: per new rank, bytes needed and read and requests, from the
    manifest alone (no process starts)."""
    import json

    from typer.testing import CliRunner

    from parashift.cli import app

    url = f"file://{tmp_path}/store"
    spec_file = tmp_path / "job.yaml"
    model = {"n_layers": 2, "d_model": 60, "n_heads": 6, "vocab_size": 260, "seq_len": 24}  # the bytes tokenizer: >= 256
    spec_file.write_text(json.dumps({"name": "moving", "model": model, "storage": {"url": url},
                                     "resources": {"devices": 2, "kind": "cpu"}}))
    runner = CliRunner()
    empty = runner.invoke(app, ["reshard-plan", str(spec_file)])
    assert empty.exit_code == 0 and "no committed checkpoint" in empty.output

    layout = state_layout(PLANS["dp2xtp2"], GPTSpec(**model))
    store = CheckpointStore(ObjectStore(url), "moving")
    save_all_ranks(store, layout, global_state(layout), step=5)
    result = runner.invoke(app, ["reshard-plan", str(spec_file), "--mesh", "tp=3", "--json"])
    assert result.exit_code == 0, result.output
    shown = json.loads(result.output)
    assert shown["step"] == 5 and len(shown["ranks"]) == 3
    assert shown["totals"]["bytes_read"] == shown["totals"]["bytes_needed"] > 0
    table = runner.invoke(app, ["reshard-plan", str(spec_file), "--devices", "3"])
    assert table.exit_code == 0 and "requests" in table.output
    assert next(line for line in table.output.splitlines() if line.startswith("total:")).endswith("from this node")
    # `parashift status`: where the job stands, from its storage alone
    (tmp_path / "store/jobs/moving/ckpt/00000007").mkdir()
    (tmp_path / "store/jobs/moving/ckpt/00000007/manifest.json").write_text('{"format_version": 3}')
    JobLease(ObjectStore(url), "moving").acquire()
    runner.invoke(app, ["stop", str(spec_file), "--reason", "a test"])
    shown = runner.invoke(app, ["status", str(spec_file)])
    assert shown.exit_code == 0, shown.output
    lines = {line.split()[0]: line for line in shown.output.splitlines()[1:]}
    assert "holds it, its lease live for" in lines["run"]
    assert lines["checkpoints"].startswith("  checkpoints   5 (newest: step 5 of"), lines
    assert "on 4 devices" in lines["newest"] and "step 7" in lines["refused"] and "(a test)" in lines["stop"]


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_a_wrong_manifest_never_loads(saved, tmp_path_factory, data: st.DataObject) -> None:
    """Well-formed manifests that do not describe this job's state (a shape changed with
    consistent bytes, a dtype, a name, a tensor dropped or added, a slice moved or resized, an
    object renamed or pointed outside the folder, sizes no machine holds) are refused with a
    line naming the step, and nothing is loaded: no crash, no wrong state, no fresh start
    unless asked for."""
    import logging

    from parashift.trainer.checkpoint import CheckpointsUnusable, restore_latest

    store, layout, _ = saved["dp2"]
    manifest = store.latest()
    assert manifest is not None
    raw = json.loads(manifest.model_dump_json())
    original = json.dumps(raw)
    # 2-D and not square: a transposed shape really differs
    names = sorted(n for n, t in raw["tensors"].items() if len(t["shape"]) == 2 and t["shape"][0] != t["shape"][1])
    name = data.draw(st.sampled_from(names))
    tensor = raw["tensors"][name]
    piece = tensor["slices"][0]
    how = data.draw(st.sampled_from(["transpose", "dtype", "rename", "drop", "extra", "offset", "huge", "lengths",
                                     "byte_offset", "object", "escape", "chunks"]))
    if how == "transpose":  # the same bytes, another shape: every slice and checksum consistent
        tensor["shape"] = tensor["shape"][::-1]
        for s in tensor["slices"]:
            s["lengths"] = s["lengths"][::-1]
    elif how == "dtype":
        tensor["dtype"] = data.draw(st.sampled_from(["int32", "float16", "bfloat16", "complex64", "nonsense"]))
    elif how == "rename":
        raw["tensors"][name + "x"] = {**tensor, "name": name + "x",
                                      "slices": [{**s, "tensor": name + "x"} for s in tensor["slices"]]}
        del raw["tensors"][name]
    elif how == "drop":
        del raw["tensors"][name]
    elif how == "extra":
        raw["tensors"]["model/ghost"] = {**tensor, "name": "model/ghost",
                                         "slices": [{**s, "tensor": "model/ghost"} for s in tensor["slices"]]}
    elif how == "offset":
        piece["offsets"] = [data.draw(st.integers(-3, 10**12)), 0]
    elif how == "huge":  # byte counts consistent with a shape no machine holds
        tensor["shape"] = [10**12, tensor["shape"][1]]
        piece["lengths"] = [10**12, tensor["shape"][1]]
        piece["nbytes"] = 4 * 10**12 * tensor["shape"][1]
        piece["chunks"] = [[piece["nbytes"], 0]]
    elif how == "lengths":
        piece["lengths"] = [data.draw(st.integers(0, 10**6)), piece["lengths"][1]]
    elif how == "byte_offset":
        piece["byte_offset"] = data.draw(st.integers(0, 10**12))
    elif how == "object":
        other = data.draw(st.sampled_from(sorted(set(raw["objects"]) - {piece["object"]})))
        piece["object"] = other
    elif how == "escape":
        bad = data.draw(st.sampled_from(["../rank00000.bin", "/etc/passwd", "a/b.bin", "manifest.json", ".."]))
        raw["objects"][bad] = {"key": bad, "nbytes": 16}
        piece["object"] = bad
    else:  # chunk sizes that add up but do not cut at rows
        n = piece["nbytes"]
        cut = data.draw(st.integers(1, max(1, n - 1)))
        piece["chunks"] = [[cut, piece["chunks"][0][1]], [n - cut, 0]] if n > 1 else piece["chunks"]
    assume(json.dumps(raw) != original)
    folder = tmp_path_factory.mktemp("wrong")
    twin = CheckpointStore(ObjectStore(f"file://{folder}"), "job")
    for key in store.store.list(store.paths.ckpt_dir(3)):
        if not key.endswith("manifest.json"):
            twin.store.put(key, store.store.get(key))
    body = json.dumps(raw, separators=(",", ":")).encode()  # under a right digest: wrong, not corrupted
    twin.store.put(twin.paths.manifest(3), body[:-1] + f',"digest":"{manifest_digest(body)}"}}'.encode())
    logger = logging.getLogger("parashift.checkpoint")
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logger.addHandler(handler)
    try:
        for rank in range(layout.world_size):
            with pytest.raises(CheckpointsUnusable, match="none of the 1 committed"):
                restore_latest(twin, layout, rank)
            assert restore_latest(twin, layout, rank, start_over=True) is None
    finally:
        logger.removeHandler(handler)
    assert any("step 3" in line for line in seen), seen
    if how in ("transpose", "dtype", "rename", "drop", "extra"):  # which tensor
        assert any(name.split("/")[-1] in line or "ghost" in line for line in seen), seen
    assert all("\n" not in line for line in seen), "one line per refusal"


# Computes a ReconfigPlan from the format-2 fixture's manifest file (argv[1]: the store's root)
# onto a Layout built by hand, and reports what was loaded meanwhile.
PLAN_WITHOUT_THE_RUNTIME = """
import json, sys
from pathlib import Path
from parashift import ptc
from parashift.ptc.layout import TensorPlacement
from parashift.storage import CheckpointStore, ObjectStore, decode_manifest

root = sys.argv[1]
layout = ptc.mesh_layout({"tp": 2}, {
    "model/w": TensorPlacement((4, 6), "float32", tp_dim=0),
    "model/b": TensorPlacement((6,), "float32"),
    **{f"rng/rank{r:05d}/cpu": TensorPlacement((8,), "uint8", rank=r) for r in range(2)},
})
store = CheckpointStore(ObjectStore(root), "format2")
newest = ptc.reshard_plan(store, layout)
manifest = decode_manifest(Path(root, "jobs/format2/ckpt/00000004/manifest.json").read_bytes())
given = ptc.reshard_plan(store, layout, manifest=manifest)
print(json.dumps({"step": newest.step, "totals": newest.totals(), "same": given.summary() == newest.summary(),
                  "loaded": sorted(m for m in sys.modules if m.split(".")[:2] in (["parashift", "trainer"], ["parashift", "tasks"], ["parashift", "flows"])
                                   or m.startswith("torch.distributed.tensor"))}))
"""


def test_a_reshard_plan_needs_no_distributed_runtime(tmp_path) -> None:
    """`ptc.reshard_plan` goes from a manifest file and a Layout to a ReconfigPlan with none of
    parashift's torch.distributed modules loaded (trainer.checkpoint, .parallel, .mesh, .worker;
    nothing of trainer/ at all), nor DTensor's (torch.distributed.tensor). `import torch` itself
    loads torch.distributed's core in torch 2.13, so that module cannot be the test."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    shutil.copytree(root / "tests/fixtures/format2/jobs", tmp_path / "jobs")
    done = subprocess.run([sys.executable, "-c", PLAN_WITHOUT_THE_RUNTIME, str(tmp_path)], cwd=root,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    shown = json.loads(done.stdout.strip().splitlines()[-1])
    assert shown["loaded"] == [] and shown["same"] and shown["step"] == 4
    assert shown["totals"]["bytes_needed"] == shown["totals"]["bytes_read"] == 4 * 24 + 2 * 4 * 6 + 2 * 8


@pytest.mark.parametrize("old,new", [("dp2", "dp4"), ("tp2", "dp3"), ("dp4", "tp2"), ("pp2xtp2", "tp2")])
def test_live_copies_serve_what_live_ranks_hold_and_storage_the_rest(saved, old: str, new: str) -> None:
    """With every old rank alive (a warm change): each new rank reads a box from its own memory
    where it holds it, from a peer where a peer does, from storage only where no live rank
    does; readers of replicated boxes take them from all of their holders."""
    from parashift.ptc.reconfig import LIVE, live_holder, rank_reads, with_live_copies
    from parashift.ptc.reshard import stored_boxes

    store, old_layout, _ = saved[old]
    new_layout = state_layout(PLANS[new], CONFIG)
    stored, dtypes = stored_boxes(store.latest())
    storage_order_of = {n: storage_order(len(t.shape), t.split_dim) for n, t in old_layout.tensors.items()}
    alive = range(min(old_layout.world_size, new_layout.world_size))  # the old ranks the new job keeps
    holdings = {r: [(n, b, storage_order_of[n]) for n, b in sorted(old_layout.boxes_of(r).items())] for r in alive}
    holders_used: set[int] = set()
    for rank in range(new_layout.world_size):
        boxes, live = with_live_copies(stored, holdings, rank)
        wanted = {n: b for n, b in new_layout.boxes_of(rank).items() if n in stored}
        reads = rank_reads(boxes, dtypes, wanted, rank, live)
        assert reads.bytes_read == reads.bytes_needed
        assert_every_byte_checked_once(reads)
        for request in reads.requests:
            for piece in request.pieces:
                held_by = [r for r, held in holdings.items()
                           if (piece.tensor, piece.source.box, piece.source.order) in held]
                if request.source == LIVE:
                    holder = live_holder(request.object)[0]
                    assert holder in held_by and (rank not in held_by or holder == rank)
                    if holder != rank:
                        holders_used.add(holder)
                else:
                    assert not held_by, (piece.tensor, "read from storage though a live rank holds it")
    if new_layout.world_size > old_layout.world_size and old.startswith("dp"):
        assert holders_used == set(alive), "the new ranks take replicated boxes from every holder"
