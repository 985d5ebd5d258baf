"""Checkpoints restored in one process with a real model and optimizer: retention never lets
a refused checkpoint push a good one out, a step without its manifest is named, and what is
restored is bit for bit what was saved."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from jobs import tiny_spec
from parashift.models.gpt.model import GPT, GPTConfig
from parashift.specs.plan import Plan
from parashift.storage import job_store
from parashift.trainer.checkpoint import Checkpointer, CheckpointsUnusable, restore_latest
from parashift.trainer.layout import state_layout
from parashift.trainer.optim import LocalShardAdamW
from parashift.trainer.state import apply_state, collect_state, restore_destinations, rng_state_bytes

CPU = torch.device("cpu")


class Job:
    """A 1-layer GPT and its optimizer after one step, with a checkpoint store on files."""

    def __init__(self, root: Path) -> None:
        self.spec = tiny_spec("trust", f"file://{root}", resources={"devices": 1, "kind": "cpu"})
        self.config = GPTConfig.of(self.spec.model)
        self.layout = state_layout(Plan.data_parallel(1), self.spec.model, rng_state_bytes(CPU))
        self.store = job_store(self.spec)
        self.root = root

    def fresh(self, seed: int = 0) -> tuple[GPT, LocalShardAdamW]:
        torch.manual_seed(seed)
        model = GPT(self.config)
        optimizer = LocalShardAdamW(model, self.spec, CPU)
        model(torch.randint(0, 256, (2, 8))).float().sum().backward()
        optimizer.step()
        return model, optimizer

    def save(self, steps: list[int], keep: int = 2, resumed_from=None, seed: int = 0) -> dict[str, torch.Tensor]:
        model, optimizer = self.fresh(seed)
        saver = Checkpointer(self.store, self.layout, 0, keep=keep, resumed_from=resumed_from)
        for step in steps:
            saver.save(step, collect_state(model, optimizer, 0, CPU), {"samples_consumed": 8 * step}, {}, {},
                       blocking=True)
        saver.close()  # waits for the pruner too
        return {k: v.clone() for k, v in collect_state(model, optimizer, 0, CPU).items()}

    def restore(self, start_over: bool = False):
        model, optimizer = self.fresh(seed=99)
        restored = restore_latest(self.store, self.layout, 0, destinations=restore_destinations(optimizer),
                                  start_over=start_over)
        if restored is not None:
            apply_state(restored.tensors, model, optimizer, 0, CPU, adopt=True)
        return restored, collect_state(model, optimizer, 0, CPU)

    def corrupt(self, step: int) -> None:
        victim = self.root / f"jobs/trust/ckpt/{step:08d}/rank00000.bin"
        data = bytearray(victim.read_bytes())
        data[len(data) // 3] ^= 0xFF
        victim.write_bytes(bytes(data))


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_refused_checkpoints_do_not_get_a_new_one_pruned(tmp_path: Path) -> None:
    """keep 2: steps 10 and 15 stay, both turn unreadable. The restore refuses them and, told to
    start over, trains from step 0; its step-5 checkpoint survives pruning, and a crash after
    it resumes there, bit for bit."""
    job = Job(tmp_path)
    job.save([5, 10, 15])
    assert job.store.committed_steps() == [10, 15]
    job.corrupt(10)
    job.corrupt(15)
    with pytest.raises(CheckpointsUnusable, match="none of the 2 committed checkpoints of trust"):
        job.restore()
    restored, _ = job.restore(start_over=True)
    assert restored is None
    saved = job.save([5], seed=1)  # the new lineage's first checkpoint
    assert job.store.committed_steps() == [5, 10, 15]
    restored, state = job.restore()
    assert restored is not None and restored.step == 5 and restored.data_position == {"samples_consumed": 40}
    assert_same(state, saved)


def test_a_good_older_checkpoint_is_used_and_the_lineage_kept(tmp_path: Path) -> None:
    job = Job(tmp_path)
    saved = job.save([4, 8], keep=3)
    job.corrupt(8)
    restored, state = job.restore()
    assert restored is not None and restored.step == 4
    assert_same(state, saved)  # the same tensors were saved at 4 and 8
    job.save([8, 12], keep=3, resumed_from=restored.manifest)
    assert [job.store.load_manifest(s).previous_step for s in (4, 8, 12)] == [None, 4, 8]
    job.save([12, 16], keep=2, resumed_from=job.store.load_manifest(12))  # 12 saved again keeps its link
    assert [job.store.load_manifest(s).previous_step for s in (12, 16)] == [8, 12]
    assert job.store.committed_steps() == [12, 16]


def test_a_step_without_its_manifest_is_named(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    job = Job(tmp_path)
    job.save([4, 8], keep=3)
    (tmp_path / "jobs/trust/ckpt/00000008/manifest.json").unlink()
    with caplog.at_level(logging.WARNING, logger="parashift.checkpoint"):
        restored, _ = job.restore()
    assert restored is not None and restored.step == 4
    assert any("step 8 has objects but no manifest" in r.getMessage() for r in caplog.records)


def test_another_models_checkpoint_fails_the_restore(tmp_path: Path) -> None:
    """A job renamed onto another model's store: refused with the tensor, expected and found,
    not silently trained from scratch."""
    job = Job(tmp_path)
    job.save([4])
    wider = Job(tmp_path)
    wider.spec = tiny_spec("trust", f"file://{tmp_path}", resources={"devices": 1, "kind": "cpu"},
                           model={"d_model": 64})
    wider.config = GPTConfig.of(wider.spec.model)
    wider.layout = state_layout(Plan.data_parallel(1), wider.spec.model, rng_state_bytes(CPU))
    with pytest.raises(CheckpointsUnusable, match=r"is float32\[32\], this job's is float32\[64\]"):
        wider.restore()


def test_an_in_place_restore_fills_the_live_tensors_and_nothing_else(tmp_path: Path) -> None:
    """`in_place`: the parameters and the optimizer state that exist are read into (same
    memory before and after, values bit for bit the saved ones); state refused half-way is
    cleared, not kept."""
    job = Job(tmp_path)
    saved = job.save([4])
    model, optimizer = job.fresh(seed=7)
    before = {k: v.data_ptr() for k, v in collect_state(model, optimizer, 0, CPU).items() if not k.startswith("rng/")}
    destinations = restore_destinations(optimizer, in_place=True)
    assert {k: destinations[k].data_ptr() for k in before} == before
    restored = restore_latest(job.store, job.layout, 0, destinations=destinations)
    assert restored is not None
    apply_state(restored.tensors, model, optimizer, 0, CPU, adopt=True)
    after = collect_state(model, optimizer, 0, CPU)
    assert {k: after[k].data_ptr() for k in before} == before
    assert_same(after, saved)
    fresh = restore_destinations(optimizer)
    assert not any(fresh[k].data_ptr() == ptr for k, ptr in before.items())
    optimizer.clear_state()
    assert optimizer.state_tensors() == {}
