"""Where parashift state lives: an fsspec object store with ranged reads, atomic writes,
checksummed checkpoints whose manifest (itself under a digest) is committed last, one writer
per job (a lease in storage that every commit is fenced by), and one error table.

Engines deal in bytes here; tensor <-> bytes encoding lives in `ptc/`.
"""

from parashift.storage.checkpoints import (
    MANIFEST_NAME,
    CheckpointStore,
    JobPaths,
    ReadRequest,
    SlicePayload,
    holding_object_name,
    is_pending_manifest,
    job_key,
    rank_object_name,
)
from parashift.storage.errors import (
    CheckpointNotFound,
    ChecksumMismatch,
    MalformedManifest,
    ObjectNotFound,
    StaleLineage,
    StorageError,
    StoragePermissionError,
    TierUnusable,
    TransientStorageError,
    WriteConflict,
    is_transient,
    translate_error,
)
from parashift.storage.lease import LEASE_ENV, JobLease, JobLeaseHeld, LeaseLost, LeaseToken
from parashift.storage.manifest import (
    FORMAT_VERSION,
    Manifest,
    ObjectRecord,
    SliceKey,
    SliceRecord,
    TensorRecord,
    WriterRecord,
    decode_manifest,
    encode_manifest,
)
from parashift.storage.objects import ObjectStore, StoreStats
from parashift.storage.stores import default_read_bytes_per_s, job_store, node_tier, open_store

__all__ = [
    "FORMAT_VERSION",
    "LEASE_ENV",
    "MANIFEST_NAME",
    "CheckpointNotFound",
    "CheckpointStore",
    "ChecksumMismatch",
    "JobLease",
    "JobLeaseHeld",
    "JobPaths",
    "LeaseLost",
    "LeaseToken",
    "MalformedManifest",
    "Manifest",
    "ObjectNotFound",
    "ObjectRecord",
    "ObjectStore",
    "ReadRequest",
    "SliceKey",
    "SlicePayload",
    "SliceRecord",
    "StaleLineage",
    "StorageError",
    "StoragePermissionError",
    "StoreStats",
    "TensorRecord",
    "TierUnusable",
    "TransientStorageError",
    "WriteConflict",
    "WriterRecord",
    "decode_manifest",
    "default_read_bytes_per_s",
    "encode_manifest",
    "holding_object_name",
    "is_pending_manifest",
    "is_transient",
    "job_key",
    "job_store",
    "node_tier",
    "open_store",
    "rank_object_name",
    "translate_error",
]
