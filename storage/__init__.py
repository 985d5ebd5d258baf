"""Where parashift state lives: an fsspec object store with ranged reads, atomic writes,
checksummed checkpoints whose manifest is committed last, and one error table.

Engines deal in bytes here; tensor <-> bytes encoding lives in `ptc/`.
"""

from storage.checkpoints import (
    MANIFEST_NAME,
    CheckpointStore,
    JobPaths,
    ReadRequest,
    SlicePayload,
    holding_object_name,
    job_key,
    rank_object_name,
)
from storage.errors import (
    CheckpointNotFound,
    ChecksumMismatch,
    MalformedManifest,
    ObjectNotFound,
    StorageError,
    StoragePermissionError,
    TierUnusable,
    TransientStorageError,
    is_transient,
    translate_error,
)
from storage.manifest import Manifest, ObjectRecord, SliceKey, SliceRecord, TensorRecord
from storage.objects import ObjectStore, StoreStats

__all__ = [
    "MANIFEST_NAME",
    "CheckpointNotFound",
    "CheckpointStore",
    "ChecksumMismatch",
    "JobPaths",
    "MalformedManifest",
    "Manifest",
    "ObjectNotFound",
    "ObjectRecord",
    "ObjectStore",
    "ReadRequest",
    "SliceKey",
    "SlicePayload",
    "SliceRecord",
    "StorageError",
    "StoragePermissionError",
    "StoreStats",
    "TensorRecord",
    "TierUnusable",
    "TransientStorageError",
    "holding_object_name",
    "is_transient",
    "job_key",
    "rank_object_name",
    "translate_error",
]
