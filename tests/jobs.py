"""Tiny jobs for tests that start real worker processes: small enough for 2 cores."""

from __future__ import annotations

import atexit
import os
from math import prod
from pathlib import Path
from typing import Any

import torch
from parashift.launcher.launch import LaunchResult
from parashift.launcher.processes import descendants, kill_tree
from parashift.launcher.warm_pool import WarmPool
from parashift.specs import JobSpec
from parashift.specs.plan import Plan
from parashift.storage import CheckpointStore, job_store
from parashift.trainer.checkpoint import load_tensors

__all__ = ["descendants", "kill_tree"]  # tests kill what they started, by PID tree


def tiny_spec(name: str, storage_url: str, **sections: dict[str, Any]) -> JobSpec:
    """A 1-layer GPT on a 200 kB slice of the built-in corpus; override any section (a section
    given replaces the same keys, e.g. `training={"steps": 4}` keeps the rest)."""
    data: dict[str, Any] = {
        "name": name,
        "model": {"n_layers": 1, "d_model": 32, "n_heads": 2, "vocab_size": 256, "seq_len": 32, "dropout": 0.0},
        "data": {"url": "builtin://python-stdlib", "max_bytes": 200_000},
        "optimizer": {"lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 2},
        # Steps take milliseconds here: the stop object is checked every step (the default: every 2 s).
        "training": {"global_batch": 8, "micro_batch": 2, "steps": 12, "seed": 7, "checkpoint_every": 4,
                     "stop_poll_s": 0},
        "resources": {"devices": 2, "kind": "cpu"},
        "storage": {"url": storage_url},
    }
    for section, values in sections.items():
        data[section] = {**data[section], **values} if isinstance(data.get(section), dict) else values
    return JobSpec.model_validate(data)


def startup_hook(tmp_path: Path, monkeypatch: Any, code: str) -> None:
    """`code` run by every interpreter this test starts from here on (a `sitecustomize` on
    PYTHONPATH): fault injection in workers and the forkserver they are forked from (a new
    PYTHONPATH starts a forkserver of its own)."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(code)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(hooks), *filter(None, [os.environ.get("PYTHONPATH")])]))


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


def mesh_plan(mesh: dict[str, int], **fields: object) -> Plan:
    return Plan(devices=prod(mesh.values()), mesh=mesh, strategy="hand", **fields)


# Every step's loss within this relative tolerance of the reference's.
LOSS_RTOL = 1e-5


# Warm workers shared by the whole test session (launcher.warm_pool): each job run through
# `run` skips torchrun and the interpreters' imports. Tests of launching itself (signals, a
# killed worker, hangs) call launcher.launch.launch_workers.
_POOL: list[WarmPool] = []
POOL_SIZE = 4


def warm_pool() -> WarmPool:
    if not _POOL:
        _POOL.append(WarmPool(POOL_SIZE))
        atexit.register(_POOL[0].close)
    return _POOL[0]


def run(spec: JobSpec, plan: Plan, until_step: int | None = None, schedule: str | None = None) -> LaunchResult:
    """Train `spec` under `plan` (on warm workers) until `until_step` or the end; must succeed."""
    if schedule:
        spec = spec.model_copy(update={"parallelism": spec.parallelism.model_copy(update={"pp_schedule": schedule})})
    pool = warm_pool()
    result = pool.run(spec, plan, until_step=until_step)
    assert result.returncode == 0, pool.output(0)[-8000:]
    return result


def assert_losses_match(result: LaunchResult, expected: list[float]) -> None:
    """Every step the run reported (after a resume: its steps only) against the reference."""
    losses = {e.step: e.loss for e in result.steps}
    assert result.start is not None and result.final_step is not None
    assert sorted(losses) == list(range(result.start.step + 1, result.final_step + 1))
    for step, got in losses.items():
        want = expected[step - 1]
        assert abs(got - want) <= LOSS_RTOL * abs(want), f"step {step}: {got} vs {want}"


# Adam moves an element at most ~lr per step, so 20 steps bound any difference by lr x 20;
# plans must agree within 0.1% of that bound. Seen: <= 1e-6 on every weight, up to 1.7e-5 on
# embedding rows of tokens seen once or twice (plain DDP on 3 ranks included), where Adam's
# per-element normalisation does not average rounding out.
STATE_ATOL = 1e-3 * 3e-3 * 20
# The gradient of a key bias is exactly zero (softmax ignores a shift shared by all scores),
# so Adam turns rounding noise into its updates: only Adam's bound applies there.
NOISE_ONLY = ("attn.k_proj.bias",)


def assert_state_matches(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor],
                         noise_only: tuple[str, ...] = NOISE_ONLY) -> None:
    assert state.keys() == expected.keys()
    for name, want in expected.items():
        got = state[name]
        assert got.shape == want.shape and got.dtype == want.dtype, name
        if any(part in name for part in noise_only):
            if name.startswith("model/"):
                assert got.abs().max() <= 3e-3 * 20 and want.abs().max() <= 3e-3 * 20, name
            continue
        assert torch.allclose(got, want, rtol=1e-5, atol=STATE_ATOL), f"{name}: max |d| = {(got - want).abs().max()}"


def sample_records(sample_log: Path, job: str | None = None) -> list[dict[str, Any]]:
    """The workers' sample log (PARASHIFT_SAMPLE_LOG): every record, or one job's."""
    import json

    records = [json.loads(line) for path in sample_log.glob("*.jsonl") for line in path.read_text().splitlines()]
    return [r for r in records if job is None or r["job"] == job]


def logged_segments(records: list[dict[str, Any]]) -> list[Any]:
    """A job's segments as its sample log shows them, where no SegmentResult is at hand (a
    deployed run): each launch's (devices, start step), keeping the steps up to where the next
    one started. A failure's retrained steps count for the segment that trained them again."""
    from types import SimpleNamespace

    starts = sorted({(r["start_step"], r["world_size"]) for r in records})
    last = max(r["step"] for r in records)
    return [SimpleNamespace(start_step=start, devices=devices,
                            final_step=starts[i + 1][0] if i + 1 < len(starts) else last)
            for i, (start, devices) in enumerate(starts)]


def assert_each_sample_once(sample_log: Path, segments: list[Any] | None, steps: int, samples_per_epoch: int,
                            global_batch: int, job: str | None = None) -> None:
    """The workers' sample log (PARASHIFT_SAMPLE_LOG) over a job's segments (None: as the log
    shows them): each step counts as trained by the segment that kept it (start_step < step <=
    final_step), whose dp ranks together trained exactly the step's global batch; over the whole
    run every sample of each epoch is trained exactly once (every full epoch, all of its samples)."""
    from collections import Counter

    records = sample_records(sample_log, job)
    segments = segments if segments is not None else logged_segments(records)
    trained: Counter[tuple[int, int]] = Counter()
    for step in range(1, steps + 1):
        keeper = next(s for s in segments if s.start_step < step <= s.final_step)
        shares = {r["dp_rank"]: r["ids"] for r in records  # tensor/pipeline peers log the same share
                  if r["step"] == step and r["start_step"] == keeper.start_step and r["world_size"] == keeper.devices}
        assert sum(len(ids) for ids in shares.values()) == global_batch, f"step {step}: {shares}"
        trained.update(tuple(i) for ids in shares.values() for i in ids)
    assert max(trained.values()) == 1, [s for s, n in trained.items() if n > 1][:5]
    epochs = Counter(epoch for epoch, _ in trained)
    assert len(trained) == steps * global_batch
    for epoch, count in epochs.items():
        if epoch < max(epochs):
            assert count == samples_per_epoch, f"epoch {epoch}: {count} of {samples_per_epoch} samples"
        assert {i for e, i in trained if e == epoch} <= set(range(samples_per_epoch))
