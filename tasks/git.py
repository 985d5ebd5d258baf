"""Specs from a git repository: the files of one folder at one commit, and a record of which
spec contents have been trained, so that each new or changed spec is trained once."""

from __future__ import annotations

import hashlib
import subprocess
import tempfile
from datetime import UTC, datetime
from pathlib import Path

from parashift.specs import JobSpec
from parashift.storage import JobPaths, open_store
from parashift.tasks.retry import retry_if_it_may_help
from prefect import task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel

GIT_TIMEOUT_S = 120


class SpecsAtCommit(BaseModel):
    """The spec files of a repository's folder at one commit (path relative to the repository -> text)."""

    repository: str
    commit: str
    files: dict[str, str]


class GitError(RuntimeError):
    """git could not fetch the repository (the message is git's own)."""


def _git(*args: str, cwd: str | None = None) -> str:
    done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=GIT_TIMEOUT_S)
    if done.returncode != 0:
        raise GitError(f"git {' '.join(args)}: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout.strip()


@task(name="read-specs-from-git", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=5,
      retry_condition_fn=retry_if_it_may_help)
def read_specs_from_git(repository: str, branch: str = "main", folder: str = "specs") -> SpecsAtCommit:
    """The `*.yaml`/`*.yml` files of `folder` at the tip of `branch` (a shallow clone, deleted after)."""
    with tempfile.TemporaryDirectory(prefix="parashift-git-") as tmp:
        _git("clone", "--quiet", "--depth", "1", "--branch", branch, repository, tmp)
        commit = _git("rev-parse", "HEAD", cwd=tmp)
        root = Path(tmp)
        files = {str(p.relative_to(root)): p.read_text(encoding="utf-8", errors="replace")
                 for p in sorted((root / folder).glob("*.y*ml")) if p.is_file()}
    return SpecsAtCommit(repository=repository, commit=commit, files=files)


def content_hash(spec: JobSpec) -> str:
    """What decides whether a spec was trained already: its validated contents (comments,
    key order and defaults spelled out or not make no difference)."""
    return hashlib.sha256(spec.model_dump_json().encode()).hexdigest()


def _record_key(spec: JobSpec, digest: str) -> str:
    return JobPaths(spec.job_id).job_key("submissions", f"{digest}.json")


def trained_before(spec: JobSpec, digest: str) -> dict | None:
    """The record of an earlier submission of these exact contents that trained to the end."""
    store = open_store(spec.storage)
    key = _record_key(spec, digest)
    return store.get_json(key) if store.exists(key) else None


def record_trained(spec: JobSpec, digest: str, source: dict[str, str], final_step: int) -> None:
    store = open_store(spec.storage)
    store.put_json(_record_key(spec, digest), {**source, "final_step": final_step,
                                               "trained_at": datetime.now(UTC).isoformat()})
