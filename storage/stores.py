"""The one way to open a job's storage from its spec: `open_store(spec.storage)` (its
ObjectStore), `job_store(spec)` (its CheckpointStore), `node_tier(...)` (a node's local tier).

These take anything shaped like `specs.StorageSpec` / `specs.JobSpec` rather than importing
specs: storage is an engine below the spec language (specs composes the components' settings,
not the other way round), used alike by the trainer, the tasks, benchmarks and tests, and it
reads only two fields of a spec's storage section.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from parashift.storage.checkpoints import CheckpointStore
from parashift.storage.objects import MAX_TRIES, ObjectStore


class StorageSettings(Protocol):
    """Where a job's state lives (`specs.StorageSpec`)."""

    @property
    def url(self) -> str: ...

    @property
    def storage_options(self) -> Mapping[str, Any]: ...


class JobSettings(Protocol):
    """A job and its storage (`specs.JobSpec`)."""

    @property
    def job_id(self) -> str: ...

    @property
    def storage(self) -> StorageSettings: ...


def open_store(storage: StorageSettings, *, max_tries: int = MAX_TRIES,
               option_defaults: Mapping[str, Any] | None = None) -> ObjectStore:
    """The store at `storage.url` with its `storage_options` (`option_defaults` fill in what
    they leave out, e.g. a probe's short timeouts). Credentials come from the environment."""
    return ObjectStore(storage.url, {**(option_defaults or {}), **storage.storage_options}, max_tries=max_tries)


def job_store(spec: JobSettings) -> CheckpointStore:
    """The job's checkpoints (and, through `.store` and `.paths`, everything else it stores)."""
    return CheckpointStore(open_store(spec.storage), spec.job_id)


def default_read_bytes_per_s(url: str) -> float:
    """A store's read bandwidth before one was measured: local files ~1 GB/s, object stores ~100 MB/s."""
    return 1e9 if url.startswith(("file://", "/")) or "://" not in url else 1e8


def node_tier(local_tier: str | None, node: str) -> ObjectStore | None:
    """This node's local tier: the spec's folder, with `{node}` (if present) replaced by the
    node's name (nodes that share a filesystem keep apart that way)."""
    return ObjectStore(local_tier.replace("{node}", node)) if local_tier else None
