"""train_spec_file: the entry for specs committed to a repository: a path in, a run out."""

from __future__ import annotations

from parashift.flows.train import train_job
from parashift.specs import load_spec
from parashift.tasks.records import TrainSummary
from prefect import flow


@flow(name="train-spec-file")
def train_spec_file(path: str = "specs/default.yaml") -> TrainSummary:
    """Validate the spec file at `path` (relative to the deployment's working directory) and train it."""
    return train_job(load_spec(path))
