"""Restoring: the newest committed checkpoint every rank can use, read as this rank's boxes.

Rank 0 lists the committed steps once, reads the newest manifest and sends it to the others;
every rank computes its reads (`ptc.reconfig`: exact byte ranges, coalesced) and executes
exactly those, verifying every chunk. A checkpoint that fails anywhere is skipped for an older
one, by agreement of all ranks. Boxes that live ranks hold from the segment before (warm
workers: `live`) come from their memory over the process group, under the same checksums.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from parashift.ptc import Layout, Slice
from parashift.ptc.codec import tensor_bytes
from parashift.ptc.reconfig import LIVE, LOCAL, Assembly, RankReads, live_holder
from parashift.ptc.reshard import (
    REFUSALS,
    check_usable,
    node_objects,
    reads_for,
)
from parashift.storage import (
    CheckpointStore,
    Manifest,
    ObjectStore,
    ReadRequest,
    StorageError,
    TierUnusable,
    TransientStorageError,
)
from parashift.trainer.checkpoint.group import Group, agree_lowest, broadcast
from parashift.trainer.checkpoint.live import LivePeers, LiveVerificationFailed

log = logging.getLogger("parashift.checkpoint")


@dataclass
class Restored:
    step: int
    data_position: dict[str, int]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    manifest: Manifest | None = None
    pending: bool = False  # from live ranks' memory by a pending manifest: not saved yet


def restore_totals(reads: RankReads | None, group: Group = None) -> dict[str, int]:
    """Bytes every rank of the job needed and read for its restore, and where the reads came
    from (`local`: the reader's node-local tier; `live`: live ranks' memory, its own or, of
    that, `network`: another rank's, read from its memory on the same machine or sent over the
    process group; `store`: object storage), summed over ranks."""
    mine = [0] * 5
    if reads is not None:
        own = sum(r.nbytes for r in reads.requests if r.source == LIVE and live_holder(r.object)[0] == reads.rank)
        mine = [reads.bytes_needed, reads.bytes_read, reads.bytes_from(LOCAL), reads.bytes_from(LIVE), own]
    totals = torch.tensor(mine, dtype=torch.int64)
    if group is not None:
        dist.all_reduce(totals, group=group)
    needed, read, local, live, own = (int(x) for x in totals.tolist())
    return {"needed": needed, "read": read, "local": local, "live": live, "network": live - own,
            "store": read - local - live}


def execute_reads(store: CheckpointStore, step: int, reads: RankReads, tier: ObjectStore | None = None,
                  destinations: dict[str, torch.Tensor] | None = None,
                  arrived: dict[int, torch.Tensor | None] | None = None,
                  assembly: Assembly | None = None) -> dict[str, torch.Tensor]:
    """Exactly `reads`' requests, every chunk verified, assembled into this rank's boxes (into
    `destinations` where given). `arrived`: its live requests, by request index, already
    verified (`LivePeers.exchange`: the bytes, or None where they landed in `assembly`'s
    targets); the others are read from storage."""
    arrived = arrived or {}
    assembly = assembly if assembly is not None else Assembly(reads, destinations)
    rest = []
    for i, r in enumerate(reads.requests):
        if i in arrived:
            data = arrived[i]
            if data is not None:
                _scatter(data, assembly.targets[i])
        elif r.source == LIVE:
            raise ValueError(f"{r.object}: a live request whose bytes did not arrive")
        else:
            rest.append(i)
    requests = [ReadRequest(r.object, r.start, r.end, tuple(r.checks), r.source == LOCAL)
                for r in (reads.requests[i] for i in rest)]
    store.read_verified(step, requests, [assembly.targets[i] for i in rest], tier)
    return assembly.finish()


def _scatter(data: torch.Tensor, targets: list[memoryview]) -> None:
    """A request's bytes into the buffers that tile it, in order."""
    source, at = tensor_bytes(data), 0
    for target in targets:
        target[:] = source[at : at + len(target)]
        at += len(target)


def load_tensors(store: CheckpointStore, manifest: Manifest, names: list[str]) -> dict[str, torch.Tensor]:
    """Whole global tensors `names` from a committed checkpoint, checksums verified."""
    wanted = {name: Slice.whole(tuple(manifest.tensors[name].shape)) for name in names}
    return execute_reads(store, manifest.step, reads_for(manifest, wanted, 0))


def _first_reason(reason: str, rank: int, group: Group) -> str:
    """The refusal reason of the lowest rank that had one of its own (a rank whose reads went
    well knows only that another refused), for every rank."""
    if group is None:
        return reason
    reasons: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(reasons, reason if reason != _BY_ANOTHER else None, group=group)
    for other, said in enumerate(reasons):
        if said is not None:
            return said if other == 0 else f"rank {other}: {said}"
    return reason


class CheckpointsUnusable(RuntimeError):
    """Committed checkpoints exist, but none can be restored into this job: starting fresh
    would silently discard them, so the run stops unless the spec asks to start over."""


# A rank's verdict on one checkpoint; the ranks act on the lowest.
_UNREACHABLE, _REFUSED, _RESTORED = 0, 1, 2
_BY_ANOTHER = "refused by another rank"

def restore_latest(store: CheckpointStore, layout: Layout, rank: int, group: Group = None,
                   tier: ObjectStore | None = None,
                   on_reads: Callable[[int, RankReads], None] | None = None,
                   destinations: dict[str, torch.Tensor] | None = None,
                   start_over: bool = False, live: LivePeers | None = None) -> Restored | None:
    """The newest committed checkpoint that every rank reads intact and that holds exactly this
    job's state, as this rank's boxes under `layout`; None when there is none to restore.

    A checkpoint that fails a checksum, names objects outside its folder, or does not match
    the job (tensor missing or extra, other shape or dtype) is refused with one WARNING line
    and kept, for inspection; an older one is tried. When checkpoints exist but none can be
    restored, CheckpointsUnusable is raised unless `start_over`. Storage that stays
    unreachable through its retries raises (a later attempt may read the same checkpoint).
    `on_reads(step, reads)` hears this rank's reads before they start. `destinations`: fresh
    tensors to read into (not live ones: a checkpoint refused half-way must leave the live
    state as it was). `live`: what the ranks hold from the job's segment before (every rank
    passes it or None alike): boxes of its step held exactly are taken from their holders."""
    lead = rank == 0 or group is None  # the rank that lists and reads manifests for all
    listed = None
    if lead:
        listed = store.manifest_steps()
        for step in store.uncommitted_steps():
            log.warning("step %d has objects but no manifest (a save that did not finish, or a deleted manifest): "
                        "not a checkpoint", step)
    steps: list[int] = broadcast(listed, group)
    # The step live ranks hold, newer than every commit, described by a pending manifest (a
    # planned change on warm workers): tried first, from their memory alone.
    pending = live is not None and live.step > max(steps, default=-1)
    refused: list[str] = []
    for step in [*([live.step] if pending and live is not None else []), *reversed(steps)]:
        is_pending = pending and live is not None and step == live.step
        raw, verdict, reason = None, _REFUSED, _BY_ANOTHER
        if lead:
            try:
                raw = store.read_pending_bytes(step) if is_pending else store.read_manifest_bytes(step)
            except StorageError as error:
                reason = str(error)
                verdict = _UNREACHABLE if isinstance(error, TransientStorageError) and not is_pending else _REFUSED
        raw = broadcast(raw, group)
        restored = None
        if raw is not None:
            verdict, reason, restored = _read_step(store, step, raw, layout, rank, lead, tier, on_reads, destinations,
                                                   live if live is not None and live.step == step else None,
                                                   newest_committed=(steps[-1] if steps else -1) if is_pending else None)
        verdict = agree_lowest(verdict, group)
        if verdict == _RESTORED:
            return restored
        if verdict == _UNREACHABLE:
            raise StorageError(f"rank {rank}: storage unreachable while restoring the checkpoint at step {step}: {reason}")
        reason = _first_reason(reason, rank, group)
        if is_pending:  # not a checkpoint: the newest committed one is next
            if lead:
                log.warning("the state live ranks hold of step %d cannot be restored (%s): resuming from the newest "
                            "committed checkpoint", step, reason)
            continue
        if lead:  # one line per job
            log.warning("refused the checkpoint at step %d: %s", step, reason)
        refused.append(reason if f"step {step}" in reason else f"step {step}: {reason}")
    if refused and not start_over:
        raise CheckpointsUnusable(
            f"none of the {len(refused)} committed checkpoints of {store.job_id} can be restored into this job "
            f"(newest: {refused[0]}); fix or move them, or set training.if_checkpoints_unusable: start-over "
            "to train from step 0 beside them")
    if refused:
        log.warning("starting over from step 0: no committed checkpoint can be restored (%d refused)", len(refused))
    return None


def _read_step(store: CheckpointStore, step: int, raw: bytes, layout: Layout, rank: int, lead: bool,
               tier: ObjectStore | None, on_reads: Callable[[int, RankReads], None] | None,
               destinations: dict[str, torch.Tensor] | None,
               live: LivePeers | None, newest_committed: int | None = None) -> tuple[int, str, Restored | None]:
    """This rank's verdict on the checkpoint at `step` (its manifest `raw`), its reason, and its
    boxes if it read them. With `live` (the same on every rank): the exchange with the live
    ranks is a collective, so a rank that refused the checkpoint still serves its peers.
    `newest_committed` (-1: none): `raw` is a pending manifest, which must continue that step,
    and whose every box must come from a live rank (no object stores its bytes)."""
    verdict, reason = _REFUSED, _BY_ANOTHER
    manifest, wanted, reads, arrived, assembly = None, {}, None, {}, None
    pending = newest_committed is not None
    try:
        manifest = store.parse_manifest(step, raw)
        if pending and (manifest.previous_step if manifest.previous_step is not None else -1) != newest_committed:
            raise ValueError(f"its pending manifest continues step {manifest.previous_step}, the newest committed "
                             f"is {newest_committed}")
        stored = check_usable(manifest, layout, store if lead and not pending else None)
        wanted = {n: b for n, b in layout.boxes_of(rank).items() if n in manifest.tensors}
        reads = reads_for(manifest, wanted, rank, node_objects(tier, store, step) if not pending else frozenset(),
                          live.holdings if live is not None else None, stored)
        unheld = [r.object for r in reads.requests if r.source != LIVE]
        if pending and unheld:
            raise ValueError(f"rank {rank} needs bytes no live rank holds ({unheld[0]}), and no object stores them yet")
        if on_reads is not None:
            on_reads(step, reads)
        if live is not None:
            assembly = Assembly(reads, destinations)
    except TransientStorageError as error:
        reads, verdict, reason = None, _UNREACHABLE, str(error)
    except REFUSALS as error:
        reads, verdict, reason = None, _REFUSED, str(error) or type(error).__name__
    if live is not None:
        try:
            arrived = live.exchange(reads, rank, assembly.targets if assembly is not None else None)
        except LiveVerificationFailed as error:
            if pending:  # nothing else has these bytes
                return _REFUSED, f"state from live workers refused ({error})", None
            log.warning("rank %d: state from live workers refused (%s); reading storage", rank, error)
            assert manifest is not None
            reads, assembly, arrived = reads_for(manifest, wanted, rank, node_objects(tier, store, step)), None, {}
            if on_reads is not None:
                on_reads(step, reads)
    if reads is None or manifest is None:
        return verdict, reason, None
    try:
        try:
            tensors = execute_reads(store, step, reads, tier, destinations, arrived, assembly)
        except TierUnusable as error:  # a cache: read everything from the store instead
            log.warning("rank %d: %s; reading object storage", rank, error)
            reads = reads_for(manifest, wanted, rank)
            if on_reads is not None:
                on_reads(step, reads)
            tensors = execute_reads(store, step, reads, None, destinations)
    except TransientStorageError as error:
        return _UNREACHABLE, str(error), None
    except REFUSALS as error:
        return _REFUSED, str(error) or type(error).__name__, None
    return _RESTORED, reason, Restored(step, dict(manifest.data_position), tensors, manifest, pending)
