"""Specs committed to a git repository (a bare repository on disk as the remote), submitted by
the `submit-from-git` flow against a real Prefect server: each new or changed spec trains once,
its state lives outside the temporary checkout, the commit is recorded, and a bad spec fails
its own run with the validation message without stopping the others."""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path

import pytest
from parashift.storage import CheckpointStore, ObjectStore

pytestmark = pytest.mark.slow

JOB = """\
name: from-git
model: {{n_layers: 1, d_model: 32, n_heads: 2, vocab_size: 256, seq_len: 32, dropout: 0.0}}
data: {{url: "builtin://python-stdlib", max_bytes: 200000}}
optimizer: {{lr: 0.003, min_lr: 0.0003, warmup_steps: 2}}
training: {{global_batch: 8, micro_batch: 2, steps: {steps}, seed: 7, checkpoint_every: 4}}
resources: {{devices: 2, kind: cpu}}
storage: {{url: "file://./parashift-store"}}
"""
BAD = "name: bad-heads\nmodel: {n_layers: 1, d_model: 64, n_heads: 3}\n"


async def latest_artifact(key: str):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    async with get_client() as client:
        found = await client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))
    return max(found, key=lambda a: a.created)


def git(*args: str, cwd: Path) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def commit(work: Path, files: dict[str, str], message: str) -> str:
    for name, text in files.items():
        (work / "specs" / name).write_text(text)
    git("add", "-A", cwd=work)
    git("-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-q", "-m", message, cwd=work)
    git("push", "-q", "origin", "HEAD:main", cwd=work)
    return git("rev-parse", "HEAD", cwd=work)


def test_each_new_or_changed_spec_trains_once(prefect_server: None, tmp_path: Path) -> None:
    from parashift.flows.git import SubmissionsFailed, submit_from_git

    remote, work, root = tmp_path / "remote.git", tmp_path / "work", tmp_path / "durable"
    git("init", "-q", "--bare", "-b", "main", str(remote), cwd=tmp_path)
    git("clone", "-q", str(remote), str(work), cwd=tmp_path)
    (work / "specs").mkdir()
    first = commit(work, {"job.yaml": JOB.format(steps=4), "bad.yaml": BAD}, "a job and a bad spec")
    url = f"file://{remote}"

    state = submit_from_git(url, storage_root=str(root), return_state=True)
    assert state.is_failed()
    with pytest.raises(SubmissionsFailed, match=r"specs/bad.yaml:2:31: model.d_model: must be divisible by model.n_heads") as failed:
        state.result()
    assert "1 of 2 specs failed" in str(failed.value)
    store = CheckpointStore(ObjectStore(f"file://{root}/parashift-store"), "from-git")  # not in the checkout
    assert store.committed_steps() == [4]
    assert store.latest().metadata["source"] == {"repository": url, "commit": first, "path": "specs/job.yaml",
                                                 "content_hash": store.latest().metadata["source"]["content_hash"]}

    commit(work, {"bad.yaml": BAD.replace("n_heads: 3", "n_heads: 4").replace("bad-heads", "fixed")
                  + "training: {global_batch: 4, micro_batch: 2, steps: 2}\n"
                  + f"storage: {{url: 'file://{tmp_path}/fixed-store'}}\n"}, "fix the bad spec")
    again = {s.path: s for s in submit_from_git(url, storage_root=str(root))}
    assert again["specs/job.yaml"].outcome == "already-trained" and again["specs/job.yaml"].final_step == 4
    assert again["specs/bad.yaml"].outcome == "trained" and again["specs/bad.yaml"].final_step == 2
    assert store.committed_steps() == [4], "the unchanged spec was not trained again"

    raised = commit(work, {"job.yaml": JOB.format(steps=8)}, "train longer")
    third = {s.path: s for s in submit_from_git(url, storage_root=str(root))}
    assert third["specs/job.yaml"].outcome == "trained" and third["specs/job.yaml"].final_step == 8
    assert third["specs/bad.yaml"].outcome == "already-trained"
    table = asyncio.run(latest_artifact("submit-from-git-main"))
    rows = table.data if isinstance(table.data, list) else json.loads(table.data)
    assert {(r["path"], r["outcome"]) for r in rows} == {("specs/job.yaml", "trained"), ("specs/bad.yaml", "already-trained")}
    latest = store.latest()
    assert latest.step == 8 and latest.previous_step == 4, "resumed from its checkpoint at step 4"
    assert latest.metadata["source"]["commit"] == raised


def test_specs_from_git_can_go_to_a_pool_once_per_contents(prefect_server: None, tmp_path: Path) -> None:
    """With a pool, each new or changed spec is submitted to it (its controller trains it), once."""
    from parashift.flows.git import submit_from_git
    from parashift.pool.state import submissions
    from parashift.specs.pool import PoolSpec

    remote, work, root = tmp_path / "remote.git", tmp_path / "work", tmp_path / "durable"
    git("init", "-q", "--bare", "-b", "main", str(remote), cwd=tmp_path)
    git("clone", "-q", str(remote), str(work), cwd=tmp_path)
    (work / "specs").mkdir()
    commit(work, {"job.yaml": JOB.format(steps=4)}, "a job")
    pool = PoolSpec(name="shared", devices=2, storage={"url": f"file://{tmp_path}/pool-store"})  # type: ignore[arg-type]
    first = submit_from_git(f"file://{remote}", storage_root=str(root), pool=pool)
    assert [(s.path, s.outcome) for s in first] == [("specs/job.yaml", "submitted")]
    queued = submissions(ObjectStore(f"file://{tmp_path}/pool-store"), "shared", set())
    assert [spec.job_id for _, _, spec in queued] == ["from-git"]  # type: ignore[union-attr]
    assert queued[0][2].storage.url == f"file://{root}/parashift-store"  # type: ignore[union-attr]
    again = submit_from_git(f"file://{remote}", storage_root=str(root), pool=pool)
    assert [(s.path, s.outcome) for s in again] == [("specs/job.yaml", "already-submitted")]
    assert len(submissions(ObjectStore(f"file://{tmp_path}/pool-store"), "shared", set())) == 1
