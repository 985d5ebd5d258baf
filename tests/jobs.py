"""Tiny jobs for tests that start real worker processes: small enough for 2 cores."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from specs import JobSpec
from storage import CheckpointStore, job_store
from trainer.checkpoint import load_tensors
from trainer.launch import descendants, kill_tree

__all__ = ["descendants", "kill_tree"]  # tests kill what they started, by PID tree


def tiny_spec(name: str, storage_url: str, **sections: dict[str, Any]) -> JobSpec:
    """A 1-layer GPT on a 200 kB slice of the built-in corpus; override any section."""
    data: dict[str, Any] = {
        "name": name,
        "model": {"n_layers": 1, "d_model": 32, "n_heads": 2, "vocab_size": 256, "seq_len": 32, "dropout": 0.0},
        "data": {"url": "builtin://python-stdlib", "max_bytes": 200_000},
        "optimizer": {"lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 2},
        "training": {"global_batch": 8, "micro_batch": 2, "steps": 12, "seed": 7, "checkpoint_every": 4},
        "resources": {"devices": 2, "kind": "cpu"},
        "storage": {"url": storage_url},
    }
    for section, values in sections.items():
        data[section] = {**data[section], **values} if isinstance(data.get(section), dict) else values
    return JobSpec.model_validate(data)


def checkpoint_store(spec: JobSpec) -> CheckpointStore:
    return job_store(spec)


def final_state(spec: JobSpec, step: int | None = None) -> dict[str, torch.Tensor]:
    """Parameters and optimizer state of a committed checkpoint (the latest by default)."""
    store = checkpoint_store(spec)
    manifest = store.load_manifest(step) if step is not None else store.latest()
    assert manifest is not None, f"no committed checkpoint for {spec.job_id}"
    names = [n for n in manifest.tensors if n.startswith(("model/", "optim/"))]
    return load_tensors(store, manifest, names)


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert torch.equal(a[name], b[name]), f"{name} differs: max |d| = {(a[name] - b[name]).abs().max()}"


def store_url(tmp_path: Path) -> str:
    return f"file://{tmp_path / 'store'}"
