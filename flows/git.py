"""submit_from_git: every new or changed spec in a repository's `specs/` trained once.

    read the folder at the branch's tip -> for each spec: validate -> trained before? -> train_job

A spec is trained again when its contents change (say, `steps` raised): the job resumes from its
own checkpoint. Storage URLs relative to the repository (`file://./parashift-store`) are made
absolute under `storage_root`, so state never lives in a temporary checkout. The commit is on
the run (tags) and in every checkpoint's manifest (`metadata.source`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from parashift.flows.pool import submit_to_pool
from parashift.flows.train import train_job
from parashift.specs import environ, parse_spec
from parashift.specs.pool import PoolSpec
from parashift.tasks.artifacts import artifact_key
from parashift.tasks.credentials import environment, storage_environment
from parashift.tasks.git import content_hash, read_specs_from_git, record_trained, trained_before
from prefect import flow, tags
from prefect.artifacts import create_table_artifact
from prefect.logging import get_run_logger
from pydantic import BaseModel

# Where relative storage URLs of specs from git resolve when no storage_root is given.
STORAGE_ROOT_ENV = environ.STORAGE_ROOT


def default_storage_root() -> str:
    return os.environ.get(STORAGE_ROOT_ENV) or str(Path.home() / ".parashift")


class Submission(BaseModel):
    """What became of one spec file of the repository."""

    path: str
    job: str | None = None
    outcome: str  # trained | submitted (to a pool) | already-trained | already-submitted | failed
    final_step: int | None = None
    message: str | None = None


class SubmissionsFailed(RuntimeError):
    """Some specs of the repository could not be trained (the others were)."""


@flow(name="train-from-git", flow_run_name="train-{path}")
def train_from_git(text: str, path: str, repository: str, commit: str, storage_root: str,
                   pool: PoolSpec | None = None) -> Submission:
    """One spec file at one commit: validated (its errors, with file, line and field, are this
    run's failure message), trained unless these exact contents were trained before. With a
    `pool`: submitted to it instead (its controller trains it), once per contents."""
    logger = get_run_logger()
    spec = parse_spec(text, f"{repository}@{commit[:12]}:{path}").with_storage_root(storage_root)
    digest = content_hash(spec)
    source = {"repository": repository, "commit": commit, "path": path, "content_hash": digest}
    with environment(storage_environment(spec)):
        before = trained_before(spec, digest)
    if before is not None and before.get("pool"):
        logger.info("%s: these contents were submitted to pool %s at commit %s; nothing to do", path, before["pool"],
                    before.get("commit"))
        return Submission(path=path, job=spec.job_id, outcome="already-submitted", message=f"to pool {before['pool']}")
    if before is not None:
        logger.info("%s: these contents were trained to step %s at commit %s; nothing to do",
                    path, before.get("final_step"), before.get("commit"))
        return Submission(path=path, job=spec.job_id, outcome="already-trained", final_step=before.get("final_step"))
    if pool is not None:
        key = submit_to_pool(pool, spec)
        with environment(storage_environment(spec)):
            record_trained(spec, digest, {**source, "pool": pool.name, "submission": key}, 0)  # once per contents
        return Submission(path=path, job=spec.job_id, outcome="submitted", message=f"to pool {pool.name}")
    with tags(f"job:{spec.job_id}", f"commit:{commit[:12]}", "git"), \
            environment({environ.SOURCE: json.dumps(source)}):
        summary = train_job(spec)
    if summary.steps >= spec.training.steps:  # trained to the end (a stopped job is submitted again)
        with environment(storage_environment(spec)):
            record_trained(spec, digest, source, summary.steps)
    return Submission(path=path, job=spec.job_id, outcome="trained", final_step=summary.steps)


@flow(name="submit-from-git", flow_run_name="submit-from-git-{branch}")
def submit_from_git(repository: str, branch: str = "main", folder: str = "specs",
                    storage_root: str | None = None, pool: PoolSpec | None = None) -> list[Submission]:
    """Train each spec in `folder` of `repository` at the tip of `branch` that is new or changed
    since it was last trained; one `train-from-git` run per spec, one after another (or, given
    a `pool`, submit each to it: docs/pool.md). A spec that fails does not stop the others; this
    run then fails naming them."""
    logger = get_run_logger()
    if not repository.strip():
        raise ValueError("set the `repository` parameter: a git URL (https://..., git@..., file:///...)")
    found = read_specs_from_git(repository, branch, folder)
    logger.info("%s@%s: %d spec(s) in %s/", repository, found.commit[:12], len(found.files), folder)
    root = storage_root or default_storage_root()
    results = []
    for path, text in found.files.items():
        state = train_from_git(text, path, repository, found.commit, root, pool, return_state=True)
        if state.is_completed():
            results.append(state.result())
        else:
            results.append(Submission(path=path, outcome="failed", message=state.message))
            logger.error("%s: %s", path, state.message)
    # On the run the schedule or the user started: what became of each spec at this commit.
    create_table_artifact(key=artifact_key("submit-from-git", branch), table=[r.model_dump() for r in results],
                          description=f"{repository}@{found.commit[:12]}: {len(results)} spec(s) in {folder}/")
    failed = [r for r in results if r.outcome == "failed"]
    if failed:
        raise SubmissionsFailed(f"{len(failed)} of {len(results)} specs failed: "
                                + "; ".join(f"{r.path}: {r.message}" for r in failed))
    return results
