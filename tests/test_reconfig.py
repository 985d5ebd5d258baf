"""ReconfigPlans without processes: for every pair among a set of plans, each new rank's reads
are exactly the bytes it needs (no chunk-edge overhead for degrees up to 8), and executing them
through real storage gives, element for element, the slice of the global tensor."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.plan import Plan
from ptc import Layout
from ptc.chunks import chunk_rows, split_points, storage_order
from ptc.layout import Slice
from storage import CheckpointStore, ObjectStore
from trainer.checkpoint import Checkpointer, build_manifest, execute_reads, reads_for, reshard_plan
from trainer.layout import state_layout
from trainer.model import GPTConfig

# Uneven on purpose: vocab 250 and d_model 60 do not split evenly 3, 4 or 8 ways.
CONFIG = GPTConfig(n_layers=2, d_model=60, n_heads=6, vocab_size=250, seq_len=24)

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


def global_state(layout: Layout) -> dict[str, torch.Tensor]:
    """A distinct value in every element of every tensor."""
    out = {}
    for i, (name, t) in enumerate(sorted(layout.tensors.items())):
        dtype = torch.uint8 if t.dtype == "uint8" else torch.float32
        values = torch.arange(i * 100_000, i * 100_000 + max(1, torch.Size(t.shape).numel()), dtype=torch.float64)
        out[name] = (values % 251 if dtype == torch.uint8 else values).to(dtype).reshape(t.shape)
    return out


def box_of(tensor: torch.Tensor, box: Slice) -> torch.Tensor:
    return tensor[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.lengths, strict=True))]


def save_all_ranks(store: CheckpointStore, layout: Layout, state: dict[str, torch.Tensor], step: int) -> None:
    """What the ranks of `layout` would write, done one rank after another in this process."""
    objects, records = [], []
    for rank in range(layout.world_size):
        mine = {name: box_of(state[name], box).clone() for name, box in layout.boxes_of(rank).items()}
        payloads = Checkpointer(store, layout, rank).snapshot(mine)
        obj, recs = store.write_rank_object(step, rank, payloads)
        objects += [obj] if obj else []
        records += recs
    store.commit(build_manifest(store.job_id, step, layout, objects, records, {"samples_consumed": 0}, {}, {}))


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

    from storage import ChecksumMismatch

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

    layout = state_layout(PLANS["dp2xtp2"], GPTConfig(**model))
    store = CheckpointStore(ObjectStore(url), "moving")
    save_all_ranks(store, layout, global_state(layout), step=5)
    result = runner.invoke(app, ["reshard-plan", str(spec_file), "--mesh", "tp=3", "--json"])
    assert result.exit_code == 0, result.output
    shown = json.loads(result.output)
    assert shown["step"] == 5 and len(shown["ranks"]) == 3
    assert shown["totals"]["bytes_read"] == shown["totals"]["bytes_needed"] > 0
    table = runner.invoke(app, ["reshard-plan", str(spec_file), "--devices", "3"])
    assert table.exit_code == 0 and "requests" in table.output


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_a_wrong_manifest_never_loads(saved, tmp_path_factory, data: st.DataObject) -> None:
    """Well-formed manifests that do not describe this job's state (a shape changed with
    consistent bytes, a dtype, a name, a tensor dropped or added, a slice moved) are refused
    with a line naming the tensor, and nothing is loaded."""
    import logging

    from trainer.checkpoint import restore_latest

    store, layout, _ = saved["dp2"]
    manifest = store.latest()
    assert manifest is not None
    raw = json.loads(manifest.model_dump_json())
    # 2-D and not square: a transposed shape really differs
    names = sorted(n for n, t in raw["tensors"].items() if len(t["shape"]) == 2 and t["shape"][0] != t["shape"][1])
    name = data.draw(st.sampled_from(names))
    tensor = raw["tensors"][name]
    how = data.draw(st.sampled_from(["transpose", "dtype", "rename", "drop", "extra", "offset"]))
    if how == "transpose":  # the same bytes, another shape: every slice and checksum consistent
        tensor["shape"] = tensor["shape"][::-1]
        for s in tensor["slices"]:
            s["lengths"] = s["lengths"][::-1]
    elif how == "dtype":
        tensor["dtype"] = "int32"
    elif how == "rename":
        raw["tensors"][name + "x"] = {**tensor, "name": name + "x",
                                      "slices": [{**s, "tensor": name + "x"} for s in tensor["slices"]]}
        del raw["tensors"][name]
    elif how == "drop":
        del raw["tensors"][name]
    elif how == "extra":
        raw["tensors"]["model/ghost"] = {**tensor, "name": "model/ghost",
                                         "slices": [{**s, "tensor": "model/ghost"} for s in tensor["slices"]]}
    else:
        tensor["slices"][0]["offsets"] = [1, 0]
    folder = tmp_path_factory.mktemp("wrong")
    twin = CheckpointStore(ObjectStore(f"file://{folder}"), "job")
    for key in store.store.list(store.paths.ckpt_dir(3)):
        if not key.endswith("manifest.json"):
            twin.store.put(key, store.store.get(key))
    twin.store.put(twin.paths.manifest(3), json.dumps(raw).encode())
    logger = logging.getLogger("parashift.checkpoint")
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logger.addHandler(handler)
    try:
        assert restore_latest(twin, layout, 0) is None
    finally:
        logger.removeHandler(handler)
    assert any("step 3" in line and ("ghost" in line or name.split("/")[-1] in line or "lacks" in line) for line in seen), seen
