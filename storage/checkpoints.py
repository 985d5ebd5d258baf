"""Checkpoints on an ObjectStore: per-rank objects, a manifest committed last, verified reads.

Layout (relative to the store root):

    jobs/{job_id}/ckpt/{step:08d}/rank{r:05d}.bin   # one rank's unique slices, concatenated
    jobs/{job_id}/ckpt/{step:08d}/manifest.json     # committed last; without it no checkpoint

    jobs/{job_id}/ckpt/{step:08d}.aside-{utc}/       # what a save found at its step, set aside
    jobs/{job_id}/ckpt/pending/{step:08d}.json       # a step warm workers hold, not yet saved
    jobs/{job_id}/lease.json                         # the job's one writer (storage.lease)

A folder without a parseable manifest is an uncommitted (in progress or crashed) save: it is
invisible to `committed_steps`/`latest` and is removed by `prune` once a newer step commits.
A save never writes into what an earlier save left at its step (a refused checkpoint, a crashed
save, a symbolic link): `set_aside` moves it out of the way first, kept for inspection until
pruning passes its step. Folders set aside are not steps: listings skip them.

A pending manifest describes a step that warm workers hold in memory at a planned change and
that no object stores yet (`write_pending`): the next segment's ranks restore it from their
memory alone, checked against its CRCs, and save it again under their plan. It is never a
checkpoint: nothing but that restore reads it, and prune removes it once a newer step commits.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import re
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

from crc32c import crc32c
from parashift.storage.errors import (
    CheckpointNotFound,
    ChecksumMismatch,
    MalformedManifest,
    ObjectNotFound,
    StaleLineage,
    StorageError,
    TierUnusable,
)
from parashift.storage.lease import LeaseToken, check_fence, lease_key
from parashift.storage.manifest import (
    Manifest,
    ManifestRefused,
    ObjectRecord,
    SliceKey,
    SliceRecord,
    WriterRecord,
    decode_manifest,
    encode_manifest,
)
from parashift.storage.objects import ObjectStore
from pydantic import ValidationError

logger = logging.getLogger("parashift.storage")

MANIFEST_NAME = "manifest.json"

# A step folder set aside by a save: `{step:08d}.aside-{UTC time}`.
ASIDE = re.compile(r"(\d+)\.aside-[0-9TZ]+")

# `verify` reads slices in batches of at most this many bytes, so that checking a checkpoint
# never holds more than one batch in memory.
VERIFY_BATCH_BYTES = 256 * 2**20


# Chunk checksums are CRC-32C (the `crc32c` package: SSE4.2/ARMv8 instructions where present):
# 12 GB/s on one core of the CI machine, against 3.2 GB/s for zlib's CRC-32 and 1.1 GB/s for
# sha256, and it releases the GIL, so checksumming runs beside training. It detects corruption
# in storage and transit, which is its job here; it is not a defence against someone who can
# rewrite both the objects and the manifest.


@dataclass(frozen=True)
class SlicePayload:
    """One slice to store: its key, the order its dims are laid out in, the sizes of its
    checksum chunks, and `chunk(i)`: the bytes of chunk i (any contiguous buffer), produced
    when it is written, so a slice need not exist in stored form all at once."""

    key: SliceKey
    dim_order: tuple[int, ...]
    chunk_bytes: tuple[int, ...]
    chunk: Callable[[int], memoryview | bytes]

    @classmethod
    def of_bytes(cls, key: SliceKey, dim_order: tuple[int, ...], data: memoryview | bytes,
                 chunk_bytes: tuple[int, ...]) -> SlicePayload:
        """A slice whose stored bytes are at hand, cut into chunks without copying."""
        view = memoryview(data).cast("B")
        starts = [0]
        for n in chunk_bytes:
            starts.append(starts[-1] + n)
        if starts[-1] != len(view):
            raise ValueError(f"chunks of {key.tensor!r} cover {starts[-1]} of its {len(view)} bytes")
        return cls(key, dim_order, tuple(chunk_bytes), lambda i: view[starts[i] : starts[i + 1]])

    @property
    def nbytes(self) -> int:
        return sum(self.chunk_bytes)


@dataclass(frozen=True)
class ReadRequest:
    """Bytes [start, end) of a checkpoint object; `checks`: (offset in the request, nbytes,
    crc32c) of each chunk inside it; `local`: try this node's tier first."""

    object: str
    start: int
    end: int
    checks: tuple[tuple[int, int, int], ...] = field(default_factory=tuple)
    local: bool = False


def _whole_checks(record: SliceRecord) -> tuple[tuple[int, int, int], ...]:
    out, offset = [], 0
    for n, crc in record.chunks:
        out.append((offset, n, crc))
        offset += n
    return tuple(out)


def _checksummed(slices: Sequence[SlicePayload], crcs: list[list[int]]) -> Iterator[memoryview]:
    """Every chunk of `slices`, in order, its CRC-32C appended to `crcs` (one list per slice)
    just before it is yielded: one pass over each byte, no joined copy."""
    crcs.clear()
    for payload in slices:
        mine: list[int] = []
        crcs.append(mine)
        for i, n in enumerate(payload.chunk_bytes):
            chunk = memoryview(payload.chunk(i)).cast("B")
            if len(chunk) != n:
                raise ValueError(f"chunk {i} of {payload.key.tensor!r} has {len(chunk)} bytes, not {n}")
            mine.append(crc32c(chunk))
            yield chunk


def _slice_records(rank: int, slices: Sequence[SlicePayload], crcs: list[list[int]]) -> list[SliceRecord]:
    """The records of `slices` laid out one after another in rank `rank`'s object."""
    records: list[SliceRecord] = []
    offset = 0
    for payload, checks in zip(slices, crcs, strict=True):
        n = payload.nbytes
        records.append(
            SliceRecord(
                tensor=payload.key.tensor,
                offsets=list(payload.key.offsets),
                lengths=list(payload.key.lengths),
                object=rank_object_name(rank),
                byte_offset=offset,
                nbytes=n,
                dim_order=list(payload.dim_order),
                chunks=list(zip(payload.chunk_bytes, checks, strict=True)),
            )
        )
        offset += n
    return records


def is_pending_manifest(key_or_url: str) -> bool:
    """Whether a key (or its URL) is a pending manifest (`JobPaths.pending_manifest`): a step
    held in memory, never a checkpoint to point anyone at."""
    parent, _, name = key_or_url.rpartition("/")
    return parent.endswith("/ckpt/pending") and name.endswith(".json")


def rank_object_name(rank: int) -> str:
    """Object key, relative to the checkpoint folder, of one rank's slices."""
    return f"rank{rank:05d}.bin"


def holding_object_name(rank: int) -> str:
    """Object key, relative to the checkpoint folder, of everything one rank held (its node-local
    tier keeps it; object storage never has it)."""
    return f"hold{rank:05d}.bin"


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

    def lease(self) -> str:
        """The job's lease (storage.lease): who may write it."""
        return lease_key(self.job_id)

    def ckpt_object(self, step: int, name: str) -> str:
        """Key of an object named in a manifest (`name` relative to the checkpoint folder)."""
        return f"{self.ckpt_dir(step)}/{name}"

    def manifest(self, step: int) -> str:
        return self.ckpt_object(step, MANIFEST_NAME)

    @property
    def pending_root(self) -> str:
        return self.job_key("ckpt", "pending")

    def pending_manifest(self, step: int) -> str:
        """The manifest of a step held in memory, not saved (`CheckpointStore.write_pending`)."""
        return f"{self.pending_root}/{step:08d}.json"

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

    def launch(self, launch_id: str, name: str) -> str:
        """A launch across nodes: its rendezvous, each node's report, an abort request."""
        return self.job_key("launches", launch_id, f"{name}.json")


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
        self, step: int, rank: int, slices: Sequence[SlicePayload]
    ) -> tuple[ObjectRecord | None, list[SliceRecord]]:
        """Stream `slices` into one object `rank{rank:05d}.bin`, checksumming each chunk just
        before it is written (one pass over each byte, no joined copy).

        Returns the object's record and one SliceRecord per slice (byte range, dim order, chunk
        checksums), to be put into the manifest. An empty list writes nothing: `(None, [])`.
        """
        if not slices:
            return None, []
        crcs: list[list[int]] = []
        total = self.store.put_stream(self.paths.rank_object(step, rank), lambda: _checksummed(slices, crcs))
        return ObjectRecord(key=rank_object_name(rank), nbytes=total), _slice_records(rank, slices, crcs)

    def pending_records(self, rank: int, slices: Sequence[SlicePayload]) -> tuple[ObjectRecord | None, list[SliceRecord]]:
        """What `write_rank_object` would return for `slices`, computed from the bytes without
        writing them (a pending manifest's records: one CRC pass over memory)."""
        if not slices:
            return None, []
        crcs: list[list[int]] = []
        total = sum(len(chunk) for chunk in _checksummed(slices, crcs))
        return ObjectRecord(key=rank_object_name(rank), nbytes=total), _slice_records(rank, slices, crcs)

    def write_pending(self, manifest: Manifest, *, fence: LeaseToken | None = None) -> str:
        """Store the manifest of a step held in memory and not saved (see the module's note),
        fenced by the job's lease like a commit. Returns its URL."""
        if manifest.job_id != self.job_id:
            raise ValueError(f"manifest of job {manifest.job_id!r} written to job {self.job_id!r}")
        return self._put_fenced(self.paths.pending_manifest(manifest.step), manifest, fence,
                                f"pending step {manifest.step} of {self.job_id} not written")

    def _put_fenced(self, key: str, manifest: Manifest, fence: LeaseToken | None, refused: str) -> str:
        """Write `manifest` at `key`, with its writer's lease recorded and checked last, right
        before the write (`refused`: the LeaseLost message). Returns its URL."""
        if fence is not None:
            manifest = manifest.model_copy(update={"writer": WriterRecord(generation=fence.generation, run_id=fence.run_id)})
        raw = encode_manifest(manifest)
        if fence is not None:
            check_fence(self.store, self.job_id, fence, refused)
        self.store.put(key, raw)
        return self.store.url_for(key)

    def read_pending_bytes(self, step: int) -> bytes:
        """The raw pending manifest of `step` (CheckpointNotFound if there is none)."""
        key = self.paths.pending_manifest(step)
        try:
            return self.store.get(key)
        except ObjectNotFound as exc:
            raise CheckpointNotFound(f"no pending manifest of step {step} ({self.store.url_for(key)} missing)") from exc

    def pending_steps(self) -> list[int]:
        """Steps with a pending manifest, ascending."""
        root = self.paths.pending_root
        steps = set()
        for key in self.store.list(root):
            name = key[len(root) + 1 :]
            if name.endswith(".json") and name[:-5].isdigit():
                steps.add(int(name[:-5]))
        return sorted(steps)

    def commit(self, manifest: Manifest, *, fence: LeaseToken | None = None,
               skipped: Collection[int] | None = None) -> str:
        """Check every recorded object is stored with its size, then write manifest.json (last),
        with its digest. Returns the manifest's URL. Re-committing the same step overwrites its
        manifest.

        `fence`: the writer's lease token (storage.lease), recorded in the manifest as `writer`;
        the commit is refused (LeaseLost) unless the job's lease is still that one, checked just
        before the manifest is written. `skipped`: the steps this writer knew of and chose not to
        continue from (the ones its restore refused or left, its own earlier commits); with it,
        the manifest's `previous_step` must be the newest committed step but those (StaleLineage
        otherwise: another writer committed since). Without either, unfenced as before.
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
        if skipped is not None:
            self.check_lineage(step, manifest.previous_step, skipped)
        url = self._put_fenced(self.paths.manifest(step), manifest, fence, f"step {step} of {self.job_id} not committed")
        logger.info("committed checkpoint %s", url)
        return url

    def check_lineage(self, step: int, previous_step: int | None, skipped: Collection[int]) -> None:
        """StaleLineage unless `previous_step` is the newest committed step apart from
        `skipped` (and nothing but those was committed at `step` itself)."""
        floor = -1 if previous_step is None else previous_step
        newer = [s for s in self._manifest_steps() if s > floor and s not in skipped]
        if newer:
            listed = ", ".join(str(s) for s in newer[:5]) + (" ..." if len(newer) > 5 else "")
            raise StaleLineage(
                f"step {step} of {self.job_id} not committed: it continues step {previous_step}, but step(s) {listed} "
                "were committed since this writer started (another writer of this job?): a manifest only ever "
                "continues the newest committed step")

    def set_aside(self, step: int, *, fence: LeaseToken | None = None,
                  skipped: Collection[int] | None = None) -> str | None:
        """Before a save writes `step`: move whatever is stored at its folder (a refused
        checkpoint, a crashed save, a symbolic link anyone left there) to
        `{step:08d}.aside-{UTC time}`, so the save never writes through it. Local files: one
        rename (a link is renamed, never followed); elsewhere a copy, then the originals
        deleted, manifest first. Returns the new folder's URL, None when there was nothing.

        `fence` and `skipped` as for `commit`: a writer whose lease is gone, or a step
        committed by another writer since this one started, is refused, never moved."""
        folder = self.paths.ckpt_dir(step)
        if not self.store.entry_exists(folder):
            return None
        if fence is not None:
            check_fence(self.store, self.job_id, fence, f"step {step} of {self.job_id} not saved")
        if skipped is not None and step not in skipped and step in self._manifest_steps():
            raise StaleLineage(f"step {step} of {self.job_id} not saved: it was committed since this writer started "
                               "(another writer of this job?)")
        aside = f"{folder}.aside-{datetime.now(UTC).strftime('%Y%m%dT%H%M%S%fZ')}"
        if self.store.is_local:
            self.store.rename_local(folder, aside)
        else:
            for key in self.store.list(folder):
                self.store.copy(key, aside + key[len(folder):])
            self.store.delete(self.paths.manifest(step))  # first: never committed with objects missing
            self.store.delete(folder)
        url = self.store.url_for(aside)
        logger.warning("step %d: what an earlier save left in its folder is set aside as %s; the new save writes a "
                       "fresh folder", step, url)
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

    def manifest_steps(self) -> list[int]:
        """Steps with a manifest, ascending: one listing, nothing read."""
        return self._manifest_steps()

    def read_manifest_bytes(self, step: int) -> bytes:
        """The raw manifest of `step` (CheckpointNotFound if there is none), to parse with
        `parse_manifest` where it is used (e.g. after sending it to other ranks)."""
        key = self.paths.manifest(step)
        try:
            return self.store.get(key)
        except ObjectNotFound as exc:
            raise CheckpointNotFound(
                f"no committed checkpoint at step {step} ({self.store.url_for(key)} missing)"
            ) from exc

    def load_manifest(self, step: int) -> Manifest:
        """The manifest of `step`; CheckpointNotFound if not committed, MalformedManifest if broken."""
        return self.parse_manifest(step, self.read_manifest_bytes(step))

    def parse_manifest(self, step: int, raw: bytes) -> Manifest:
        """Validate the manifest bytes of `step` (by their format version's reader, digest
        checked: `storage.manifest.decode_manifest`); MalformedManifest, one line, if they are
        not one."""
        key = self.paths.manifest(step)
        try:
            manifest = decode_manifest(raw)
        except ManifestRefused as exc:
            raise MalformedManifest(f"manifest {self.store.url_for(key)} refused: {exc}") from exc
        except ValidationError as exc:  # one line: where in the manifest, and what is wrong
            found = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()[:3])
            more = f" (and {exc.error_count() - 3} more)" if exc.error_count() > 3 else ""
            raise MalformedManifest(f"malformed manifest {self.store.url_for(key)}: {found}{more}") from exc
        except (ValueError, TypeError) as exc:
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

    def read_verified(self, step: int, requests: Sequence[ReadRequest], targets: Sequence[list[memoryview]] | None = None,
                      tier: ObjectStore | None = None) -> list[list[memoryview]]:
        """Read each request into its target buffers (which tile its range, in order; one new
        buffer each when not given), and check every chunk it covers against its CRC-32C.
        Requests marked local are served from `tier` (this node's copies); if any of them
        fails, TierUnusable (local copies may be objects the store does not have: the caller
        plans its reads again without the tier). Raises ChecksumMismatch rather than return
        bytes that differ from what was written."""
        if targets is None:
            targets = [[memoryview(bytearray(r.end - r.start))] for r in requests]
        jobs = list(zip(requests, targets, strict=True))
        for request, buffers in jobs:
            if sum(len(b) for b in buffers) != request.end - request.start:
                raise ValueError(f"buffers of {sum(len(b) for b in buffers)} bytes for a request of {request.end - request.start}")

        def verify(request: ReadRequest, buffers: list[memoryview]) -> None:
            ends = list(itertools.accumulate(len(b) for b in buffers))
            for offset, n, expected in request.checks:
                i = bisect.bisect_right(ends, offset)  # the buffer this chunk starts in; it lies within it
                within = offset - (ends[i - 1] if i else 0)
                actual = crc32c(buffers[i][within : within + n])
                if actual != expected or within + n > len(buffers[i]):
                    where = request.start + offset
                    raise ChecksumMismatch(self.store.url_for(self.paths.ckpt_object(step, request.object)), where,
                                           where + n, f"{expected:08x}", f"{actual:08x}")

        def read(store: ObjectStore, batch: list[tuple[ReadRequest, list[memoryview]]]) -> None:
            store.read_into([(self.paths.ckpt_object(step, r.object), r.start, t) for r, t in batch],
                            then=lambda i: verify(*batch[i]))

        local = [(r, t) for r, t in jobs if r.local and tier is not None]
        remote = [(r, t) for r, t in jobs if not (r.local and tier is not None)]
        if local:
            assert tier is not None
            try:
                read(tier, local)
            except StorageError as error:  # the tier is a cache: the caller reads the store instead
                raise TierUnusable(f"node-local tier unusable for step {step}: {error}") from error
        read(self.store, remote)
        return [list(t) for t in targets]

    def read_slices(self, step: int, records: Sequence[SliceRecord]) -> list[bytes]:
        """The whole payloads of `records`, every chunk verified."""
        requests = [ReadRequest(r.object, r.byte_offset, r.byte_end, _whole_checks(r)) for r in records]
        return [b"".join(t) for t in self.read_verified(step, requests)]

    def verify(self, step: int) -> None:
        """Read and verify every chunk of the checkpoint at `step`, a batch at a time.

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

    # ------------------------------------------------------------------ pruning

    def uncommitted_steps(self) -> list[int]:
        """Steps with objects but no manifest: a save that did not finish, or a deleted manifest."""
        return sorted(self._step_folders() - set(self._manifest_steps()))

    def lineage(self, newest: int, keep: int) -> list[int]:
        """`newest` and the checkpoints its training continued from (`previous_step` links),
        newest first, at most `keep`: the ones retention keeps. A link to a checkpoint that is
        missing or does not parse ends the chain."""
        chain: list[int] = []
        step: int | None = newest
        while step is not None and len(chain) < keep and step not in chain:
            try:
                manifest = self.load_manifest(step)
            except (CheckpointNotFound, MalformedManifest):
                break
            chain.append(step)
            step = manifest.previous_step
        return chain

    def prune(self, keep: int, newest: int | None = None) -> list[int]:
        """Keep `newest` (the checkpoint just committed; by default the newest that parses) and
        the checkpoints its training continued from, `keep` in all; delete the committed ones
        older than those and crashed saves below `newest`.

        Only that lineage counts: a checkpoint a restore refused, or one of a timeline the job
        left, is never one of the kept, so it cannot push a good one out. Those older than the
        kept ones go with them; newer ones are left (for inspection, until a save of the same
        step replaces them). Returns the deleted steps.
        """
        if keep < 1:
            raise ValueError("keep must be >= 1: the newest committed checkpoint is never deleted")
        listed = self._manifest_steps()
        if newest is None:
            for step in reversed(listed):
                if self.lineage(step, 1):
                    newest = step
                    break
            else:
                return []
        kept = self.lineage(newest, keep)
        if not kept:
            return []
        doomed = {s for s in listed if s < kept[-1]}
        doomed |= {s for s in self._step_folders() - set(listed) if s < newest}
        for step in sorted(doomed):
            # Manifest first: a half-deleted checkpoint must read as uncommitted, never as
            # committed with missing objects.
            self.store.delete(self.paths.manifest(step))
            self.store.delete(self.paths.ckpt_dir(step))
            logger.info("pruned checkpoint step %d of job %s", step, self.job_id)
        for name, step in self._aside_folders():  # set aside by a save: kept as long as their step would be
            if step < kept[-1]:
                self.store.delete(self.paths.job_key("ckpt", name))
        for step in self.pending_steps():  # a step held in memory that a newer commit supersedes
            if step <= newest:
                self.store.delete(self.paths.pending_manifest(step))
        return sorted(doomed)

    def _aside_folders(self) -> list[tuple[str, int]]:
        """(folder name, step) of every folder a save set aside."""
        out = set()
        if self.store.is_local:  # a folder set aside may be a link: named, never followed
            found = self.store.local_entries(self.paths.ckpt_root)
        else:
            found = [key[len(self.paths.ckpt_root) + 1 :].split("/", 1)[0] for key in self.store.list(self.paths.ckpt_root)]
        for name in found:
            match = ASIDE.fullmatch(name)
            if match:
                out.add((name, int(match.group(1))))
        return sorted(out)
