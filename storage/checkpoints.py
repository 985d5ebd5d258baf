"""Checkpoints on an ObjectStore: per-rank objects, a manifest committed last, verified reads.

Layout (relative to the store root):

    jobs/{job_id}/ckpt/{step:08d}/rank{r:05d}.bin   # one rank's unique slices, concatenated
    jobs/{job_id}/ckpt/{step:08d}/manifest.json     # committed last; without it no checkpoint

A folder without a parseable manifest is an uncommitted (in progress or crashed) save: it is
invisible to `committed_steps`/`latest` and is removed by `prune` once a newer step commits.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence

from pydantic import ValidationError

from storage.errors import (
    CheckpointNotFound,
    ChecksumMismatch,
    MalformedManifest,
    ObjectNotFound,
    StorageError,
)
from storage.manifest import Manifest, ObjectRecord, SliceKey, SliceRecord
from storage.objects import ObjectStore

logger = logging.getLogger("parashift.storage")

MANIFEST_NAME = "manifest.json"

# `verify` reads slices in batches of at most this many bytes, so that checking a checkpoint
# never holds more than one batch in memory.
VERIFY_BATCH_BYTES = 256 * 2**20


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def rank_object_name(rank: int) -> str:
    """Object key, relative to the checkpoint folder, of one rank's slices."""
    return f"rank{rank:05d}.bin"


def job_key(job_id: str, *parts: str) -> str:
    """`jobs/{job_id}/{parts...}`: the key of any file of a job."""
    return JobPaths(job_id).job_key(*parts)


class JobPaths:
    """Key builders for everything a job stores, relative to the store root."""

    def __init__(self, job_id: str) -> None:
        if not job_id or "/" in job_id or job_id in (".", ".."):
            raise ValueError(f"invalid job id {job_id!r}")
        self.job_id = job_id

    def job_key(self, *parts: str) -> str:
        """`jobs/{job_id}/{parts...}`."""
        return "/".join(["jobs", self.job_id, *(str(p).strip("/") for p in parts)])

    @property
    def root(self) -> str:
        return self.job_key()

    @property
    def ckpt_root(self) -> str:
        return self.job_key("ckpt")

    def ckpt_dir(self, step: int) -> str:
        return self.job_key("ckpt", f"{step:08d}")

    def ckpt_object(self, step: int, name: str) -> str:
        """Key of an object named in a manifest (`name` relative to the checkpoint folder)."""
        return f"{self.ckpt_dir(step)}/{name}"

    def manifest(self, step: int) -> str:
        return self.ckpt_object(step, MANIFEST_NAME)

    def rank_object(self, step: int, rank: int) -> str:
        return self.ckpt_object(step, rank_object_name(rank))

    def event(self, epoch: int) -> str:
        return self.job_key("events", f"{epoch:06d}.json")

    def events_dir(self) -> str:
        return self.job_key("events")

    def profile(self, hash_: str) -> str:
        return self.job_key("profile", f"{hash_}.json")

    def control(self, name: str) -> str:
        return self.job_key("control", f"{name}.json")

    def stop(self) -> str:
        return self.control("stop")


class CheckpointStore:
    """Write, commit, find, read, verify and prune the checkpoints of one job."""

    def __init__(self, store: ObjectStore, job_id: str) -> None:
        self.store = store
        self.job_id = job_id
        self.paths = JobPaths(job_id)

    def __repr__(self) -> str:
        return f"CheckpointStore({self.store.url_for(self.paths.root)!r})"

    def job_key(self, *parts: str) -> str:
        return self.paths.job_key(*parts)

    # ------------------------------------------------------------------ writing

    def write_rank_object(
        self, step: int, rank: int, slices: Sequence[tuple[SliceKey, bytes]]
    ) -> tuple[ObjectRecord | None, list[SliceRecord]]:
        """Concatenate `slices` into one object `rank{rank:05d}.bin` (one PUT).

        Returns the object's record and one SliceRecord per slice (byte range + sha256), to be
        put into the manifest. An empty list writes nothing and returns `(None, [])`.
        """
        if not slices:
            return None, []
        name = rank_object_name(rank)
        records: list[SliceRecord] = []
        offset = 0
        for key, payload in slices:
            n = len(payload)
            records.append(
                SliceRecord(
                    tensor=key.tensor,
                    offsets=list(key.offsets),
                    lengths=list(key.lengths),
                    object=name,
                    byte_offset=offset,
                    nbytes=n,
                    sha256=sha256_hex(payload),
                )
            )
            offset += n
        blob = b"".join(payload for _, payload in slices)
        self.store.put(self.paths.rank_object(step, rank), blob)
        return ObjectRecord(key=name, nbytes=len(blob), sha256=sha256_hex(blob)), records

    def commit(self, manifest: Manifest) -> str:
        """Check every recorded object is stored with its size, then write manifest.json (last).

        Returns the manifest's URL. Re-committing the same step overwrites its manifest.
        """
        if manifest.job_id != self.job_id:
            raise ValueError(f"manifest of job {manifest.job_id!r} committed to job {self.job_id!r}")
        step = manifest.step
        for obj in manifest.objects.values():
            key = self.paths.ckpt_object(step, obj.key)
            try:
                size = self.store.size(key)
            except ObjectNotFound as exc:
                raise StorageError(
                    f"cannot commit step {step}: {self.store.url_for(key)} is missing"
                ) from exc
            if size != obj.nbytes:
                raise StorageError(
                    f"cannot commit step {step}: {self.store.url_for(key)} has {size} bytes, "
                    f"the manifest records {obj.nbytes}"
                )
        key = self.paths.manifest(step)
        self.store.put(key, manifest.model_dump_json(indent=1).encode())
        url = self.store.url_for(key)
        logger.info("committed checkpoint %s", url)
        return url

    # ------------------------------------------------------------------ finding

    def _step_folders(self) -> set[int]:
        """Steps that have a folder with at least one object (committed or not)."""
        steps: set[int] = set()
        for key in self.store.list(self.paths.ckpt_root):
            head = key[len(self.paths.ckpt_root) + 1 :].split("/", 1)[0]
            if head.isdigit():
                steps.add(int(head))
        return steps

    def _manifest_steps(self) -> list[int]:
        """Steps whose folder holds a manifest.json (parseable or not), ascending."""
        steps = set()
        for key in self.store.list(self.paths.ckpt_root):
            parts = key[len(self.paths.ckpt_root) + 1 :].split("/")
            if len(parts) == 2 and parts[0].isdigit() and parts[1] == MANIFEST_NAME:
                steps.add(int(parts[0]))
        return sorted(steps)

    def load_manifest(self, step: int) -> Manifest:
        """The manifest of `step`; CheckpointNotFound if not committed, MalformedManifest if broken."""
        key = self.paths.manifest(step)
        try:
            raw = self.store.get(key)
        except ObjectNotFound as exc:
            raise CheckpointNotFound(
                f"no committed checkpoint at step {step} ({self.store.url_for(key)} missing)"
            ) from exc
        try:
            manifest = Manifest.model_validate_json(raw)
        except (ValidationError, ValueError, json.JSONDecodeError) as exc:
            raise MalformedManifest(f"malformed manifest {self.store.url_for(key)}: {exc}") from exc
        if manifest.step != step or manifest.job_id != self.job_id:
            raise MalformedManifest(
                f"{self.store.url_for(key)} describes job {manifest.job_id!r} step {manifest.step}"
            )
        return manifest

    def committed_steps(self) -> list[int]:
        """Steps with a manifest that exists and parses, ascending.

        A malformed manifest is skipped with a warning (that step counts as uncommitted);
        `load_manifest(step)` on it raises MalformedManifest.
        """
        out = []
        for step in self._manifest_steps():
            try:
                self.load_manifest(step)
            except CheckpointNotFound:
                continue  # pruned between listing and reading
            except MalformedManifest as exc:
                logger.warning("skipping step %d: %s", step, exc)
                continue
            out.append(step)
        return out

    def latest(self) -> Manifest | None:
        """The manifest of the newest committed checkpoint, or None when there is none."""
        for step in reversed(self._manifest_steps()):
            try:
                return self.load_manifest(step)
            except CheckpointNotFound:
                continue
            except MalformedManifest as exc:
                logger.warning("skipping step %d: %s", step, exc)
        return None

    # ------------------------------------------------------------------ reading

    def read_slices(self, step: int, records: Sequence[SliceRecord]) -> list[bytes]:
        """The payloads of `records` (one batched ranged read), each checked against its sha256.

        Raises ChecksumMismatch rather than return bytes that differ from what was written.
        """
        requests = [(self.paths.ckpt_object(step, r.object), r.byte_offset, r.byte_end) for r in records]
        payloads = self.store.get_ranges(requests)
        for r, (key, start, end), data in zip(records, requests, payloads, strict=True):
            actual = sha256_hex(data)
            if actual != r.sha256:
                raise ChecksumMismatch(self.store.url_for(key), start, end, r.sha256, actual)
        return payloads

    def verify(self, step: int, *, objects: bool = False) -> None:
        """Read and verify every slice of the checkpoint at `step` (and whole objects if asked).

        Raises CheckpointNotFound, MalformedManifest, ObjectNotFound or ChecksumMismatch.
        """
        manifest = self.load_manifest(step)
        batch: list[SliceRecord] = []
        batch_bytes = 0
        for record in manifest.all_slices():
            batch.append(record)
            batch_bytes += record.nbytes
            if batch_bytes >= VERIFY_BATCH_BYTES:
                self.read_slices(step, batch)
                batch, batch_bytes = [], 0
        if batch:
            self.read_slices(step, batch)
        if objects:
            for obj in manifest.objects.values():
                key = self.paths.ckpt_object(step, obj.key)
                data = self.store.get(key)
                actual = sha256_hex(data)
                if actual != obj.sha256:
                    raise ChecksumMismatch(self.store.url_for(key), 0, len(data), obj.sha256, actual)

    # ------------------------------------------------------------------ pruning

    def prune(self, keep: int) -> list[int]:
        """Delete all but the newest `keep` committed checkpoints, and crashed saves below the newest.

        Uncommitted folders at a step above the newest committed one (a save in progress) are
        kept. Nothing is deleted while no checkpoint is committed. Returns the deleted steps.
        """
        if keep < 1:
            raise ValueError("keep must be >= 1: the newest committed checkpoint is never deleted")
        committed = self.committed_steps()
        if not committed:
            return []
        newest = committed[-1]
        doomed = set(committed[:-keep])
        doomed |= {s for s in self._step_folders() - set(committed) if s < newest}
        for step in sorted(doomed):
            # Manifest first: a half-deleted checkpoint must read as uncommitted, never as
            # committed with missing objects.
            self.store.delete(self.paths.manifest(step))
            self.store.delete(self.paths.ckpt_dir(step))
            logger.info("pruned checkpoint step %d of job %s", step, self.job_id)
        return sorted(doomed)
