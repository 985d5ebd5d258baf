"""State that live workers hold from the segment before: served to the next segment's ranks
from their memory instead of read back from storage (warm workers, `launcher.warm_pool`).

A warm worker that ends a segment at a committed checkpoint keeps its boxes of that step
(`hold`): the tensors themselves, no copy, in the stored dim order the checkpoint wrote them
in (a permuted box is copied once into that order). The next segment's ranks say what they
hold (`LivePeers.gather`); each rank's reads of the checkpoint then take a box from a live
rank's memory wherever one holds it exactly (`ptc.reconfig.with_live_copies`: its own memory
first), and from the node-local tier or object storage only what no live rank holds. A
holder's bytes are read straight from its memory when it runs on the reader's machine
(`peer_memory`), else travel point to point on the checkpoint's gloo group; either way they
are checked against the manifest's CRC-32C chunks like any read: a holder whose memory is not
the committed checkpoint's bytes is caught, and the reader reads those boxes from storage
instead. A rank that dies while bytes move fails the collective: the segment fails and recovers
from the committed checkpoint.

A warm worker whose peer died mid-step keeps its state too, at the last step it completed
(`Unrecorded`: nothing describes that step yet). Where one survivor holds every box of it (a
replicated state, every rank's generator state included), the next segment's such ranks
describe it as a pending manifest (`LivePeers.record`: one CRC pass over the state, split
between them; the lowest writes it) and the job resumes there instead of at its last commit:
the failure costs no retrained steps.

Why not torch.distributed.checkpoint: its reshard-on-load reads storage; nothing in it moves a
live rank's shards to the ranks of another world size.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from crc32c import crc32c
from parashift.ptc import Layout, Slice
from parashift.ptc.chunks import storage_order
from parashift.ptc.codec import tensor_bytes, torch_dtype
from parashift.ptc.dtensor import local_data
from parashift.ptc.reconfig import LIVE, RankReads, Request, live_holder
from parashift.ptc.transpose import copy_across_transpose
from parashift.storage import ChecksumMismatch, LeaseToken, ObjectRecord, SliceRecord, StorageError
from parashift.trainer.checkpoint.group import Group, broadcast
from parashift.trainer.checkpoint.peer_memory import allow_peers, machine_key, read_from
from parashift.trainer.checkpoint.saver import held_manifest, held_records, record_shares

log = logging.getLogger("parashift.checkpoint")

HeldBox = tuple[str, Slice, tuple[int, ...]]  # tensor, box, stored dim order


@dataclass
class Unrecorded:
    """What a pending manifest of a held step needs beyond its bytes, where nothing describes
    that step yet (a failure's survivors): the layout it was trained under and its manifest's
    fields."""

    layout: Layout
    data_position: dict[str, int]
    plan: dict[str, Any]
    metadata: dict[str, Any]


@dataclass
class HeldState:
    """One rank's boxes of the job's state at `step` of `job_id` (committed, or described by a
    pending manifest, or `unrecorded`), as stored bytes."""

    job_id: str
    step: int
    boxes: list[HeldBox]
    data: list[torch.Tensor]  # uint8, each box's bytes in its stored dim order
    unrecorded: Unrecorded | None = None

    def stored(self) -> dict[tuple[str, Slice], torch.Tensor]:
        return {(name, box): data for (name, box, _), data in zip(self.boxes, self.data, strict=True)}

    def whole(self) -> bool:
        """Whether this holds every box of its unrecorded step's layout (a replicated state)."""
        if self.unrecorded is None:
            return False
        held = self.stored()
        return all((name, box) in held for name, box, _ in self.unrecorded.layout.distinct_slices())


_held: HeldState | None = None


def hold(job_id: str, step: int, layout: Layout, rank: int, state: dict[str, torch.Tensor],
         others: dict[str, torch.Tensor] | None = None, unrecorded: Unrecorded | None = None) -> HeldState:
    """Keep this rank's boxes of `state` (the training state as committed at `step`) for the
    job's next segment in this process. Host tensors in natural order are kept as they are;
    device tensors are copied to the host, permuted ones into their stored order. `others`:
    whole tensors of the layout this rank does not hold, kept as well (other ranks' generator
    states: a few KB that make any survivor able to serve a rank that died). `unrecorded`: the
    step is neither committed nor described yet (see the module's note)."""
    global _held
    boxes, data = [], []
    mine = layout.boxes_of(rank)
    for name, tensor in sorted((others or {}).items()):
        if name not in mine and tuple(tensor.shape) == layout.tensors[name].shape:
            boxes.append((name, Slice.whole(tuple(tensor.shape)), tuple(range(tensor.dim()))))
            data.append(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8))
    for name, box in sorted(mine.items()):
        tensor = layout.tensors[name]
        order = storage_order(len(tensor.shape), tensor.split_dim)
        local = local_data(state[name]).detach()
        if tuple(local.shape) != box.lengths:
            raise ValueError(f"{name}: this rank holds {list(local.shape)}, its layout box is {list(box.lengths)}")
        if local.device.type != "cpu":  # sent over the gloo group: host memory
            local = local.cpu()
        if order != tuple(range(len(order))) or not local.is_contiguous():
            stored = torch.empty([box.lengths[d] for d in order], dtype=local.dtype)
            copy_across_transpose(stored, local.permute(order) if order else local)
            local = stored
        boxes.append((name, box, order))
        data.append(local.reshape(-1).view(torch.uint8))
    _held = HeldState(job_id, step, boxes, data, unrecorded)
    return _held


def held_boxes(job_id: str, layout: Layout, rank: int, names: Iterable[str]) -> dict[str, torch.Tensor]:
    """Of `names`, the boxes this process holds of the job exactly as `rank` needs them under
    `layout` (same box, natural dim order), as typed tensors over the held memory: a restore
    that reads into them reuses that memory instead of allocating those boxes a second time
    while the old state is still held. The bytes a restore reads into them are the committed
    ones, verified as every read is; no peer reads them any more once the live exchange has
    finished."""
    mine = held(job_id)
    if mine is None:
        return {}
    wanted, boxes = set(names), layout.boxes_of(rank)
    out = {}
    for (name, box, order), data in zip(mine.boxes, mine.data, strict=True):
        if name in wanted and boxes.get(name) == box and order == tuple(range(len(order))):
            dtype = torch_dtype(layout.tensors[name].dtype)
            out[name] = data.view(dtype).view(box.lengths)
    return out


def release() -> None:
    """Drop what this process holds (after the next segment has restored, or on a failure)."""
    global _held
    _held = None
    allow_peers(False)


def held(job_id: str) -> HeldState | None:
    return _held if _held is not None and _held.job_id == job_id else None


class LiveVerificationFailed(RuntimeError):
    """Bytes a live rank sent do not match the checkpoint's checksums: read them from storage."""


@dataclass
class LivePeers:
    """What every rank of this segment holds of the job's `step` (rank -> boxes), and which of
    them could describe that step, unrecorded, alone (`recorders`)."""

    step: int
    holdings: dict[int, list[HeldBox]]
    group: Group
    mine: HeldState | None
    recorders: list[int]
    # Holders on this machine whose memory this rank may read directly (`peer_memory`): rank ->
    # (pid, each held box's (address, bytes)).
    nearby: dict[int, tuple[int, list[tuple[int, int]]]] = field(default_factory=dict)
    # Bytes this rank received from other ranks by the last exchange: read from their memory, or
    # over the group.
    moved: dict[str, int] = field(default_factory=lambda: {"memory": 0, "group": 0})

    @classmethod
    def gather(cls, job_id: str, rank: int, group: Group) -> LivePeers | None:
        """Every rank's holdings of the newest step any of them holds (one collective, on every
        rank; `group` None: a job of one rank); None, on every rank, when no rank holds
        anything of this job."""
        mine = held(job_id)
        said = None
        if mine is not None:
            allow_peers()
            where = (machine_key(), os.getpid(), [(t.data_ptr(), t.numel()) for t in mine.data])
            said = (mine.step, mine.boxes, mine.whole(), where)
        everyone: list[Any] = [said]
        if group is not None:
            everyone = [None] * dist.get_world_size(group)
            dist.all_gather_object(everyone, said, group=group)
        steps = [s[0] for s in everyone if s is not None]
        if not steps:
            return None
        step = max(steps)
        holdings = {r: s[1] for r, s in enumerate(everyone) if s is not None and s[0] == step}
        recorders = [r for r, s in enumerate(everyone) if s is not None and s[0] == step and s[2]]
        here = machine_key()
        nearby = {r: (s[3][1], s[3][2]) for r, s in enumerate(everyone)
                  if r != rank and s is not None and s[0] == step and here is not None and s[3][0] == here}
        return cls(step, holdings, group, mine if mine is not None and mine.step == step else None, recorders,
                   nearby)

    def record(self, store: Any, rank: int, newest_committed: int) -> str | None:
        """Describe the held step as a pending manifest where no commit reaches it and nothing
        describes it yet (a failure's survivors hold it), continuing `newest_committed` (which
        every rank passes alike). Every rank that holds it whole checksums a share of it from
        its memory (`record_shares`: one CRC pass over the state, split between them, as a
        planned stop's ranks split theirs); the lowest of them writes the manifest. A collective
        when there is such a rank; returns the manifest's URL, or None (nothing to describe, or
        a share or the write failed: the restore goes on from the newest commit)."""
        if not self.recorders or self.step <= newest_committed:
            return None
        writer, mine = self.recorders[0], None
        if rank in self.recorders:
            assert self.mine is not None and self.mine.unrecorded is not None
            layout = self.mine.unrecorded.layout
            share = record_shares(layout, len(self.recorders))[self.recorders.index(rank)]
            try:
                records = held_records(store, layout, self.mine.stored(), share)
                mine = {r: (obj.model_dump() if obj else None, [s.model_dump() for s in slices])
                        for r, (obj, slices) in records.items()}
            except Exception as error:  # noqa: BLE001 - the writer hears it below; every rank goes on to the gather
                mine = f"rank {rank}: {error!r}"
        everyone: list[Any] = [mine]
        if self.group is not None:
            everyone = [None] * dist.get_world_size(self.group) if rank == writer else None  # type: ignore[assignment]
            dist.gather_object(mine, everyone, dst=writer, group=self.group)  # in memory between this job's ranks
        said = None
        if rank == writer:
            said = self._write_pending(store, everyone, newest_committed)
        return broadcast(said, self.group, src=writer)

    def _write_pending(self, store: Any, everyone: list[Any], newest_committed: int) -> str | None:
        """The pending manifest from every holder's share of the records (the writer's part of
        `record`); None, with one WARNING line, where a share or the write failed."""
        assert self.mine is not None and self.mine.unrecorded is not None
        facts = self.mine.unrecorded
        failed = [said for said in everyone if isinstance(said, str)]
        try:
            if failed:
                raise ValueError("; ".join(failed))
            records = {r: (ObjectRecord(**obj) if obj else None, [SliceRecord(**s) for s in slices])
                       for said in everyone if said for r, (obj, slices) in said.items()}
            manifest = held_manifest(store.job_id, facts.layout, self.step, records, facts.data_position, facts.plan,
                                     facts.metadata, newest_committed if newest_committed >= 0 else None)
            return store.write_pending(manifest, fence=LeaseToken.from_env())
        except (StorageError, KeyError, ValueError) as error:  # the newest commit is there still
            log.warning("rank %d: the state survivors hold of step %d not described (%s); resuming from "
                        "the newest committed checkpoint", self.recorders[0], self.step, error)
            return None

    def exchange(self, reads: RankReads | None, rank: int,
                 targets: list[list[memoryview]] | None = None) -> dict[int, torch.Tensor | None]:
        """Every rank's live requests served (a collective: every rank calls it, with its reads
        or None when it has none); returns this rank's, by request index, checked against the
        chunks' checksums: the bytes, or None where they were received straight into the
        request's one target buffer (`targets`: the buffers that tile each request, as
        `ptc.reconfig.Assembly` lays them out). Raises LiveVerificationFailed (after every
        transfer has finished) when a request's bytes do not match."""
        wanted = [] if reads is None else [
            (i, *live_holder(r.object), r.start, r.end) for i, r in enumerate(reads.requests) if r.source == LIVE]
        received: dict[int, torch.Tensor] = {}
        landed: set[int] = set()
        # What a holder on this machine holds is read from its memory first; the rest goes over
        # the group. The holders keep their memory as it is until every rank has come to the
        # gather below, so no read races a change of it.
        for i, holder, index, start, end in wanted:
            if holder in self.nearby and holder != rank:
                into = self._target(i, end - start, targets)
                pid, boxes = self.nearby[holder]
                if index < len(boxes) and end <= boxes[index][1] and \
                        read_from(pid, boxes[index][0] + start, into):
                    received[i] = into
                    self.moved["memory"] += into.numel()
                    if targets is not None and _is_target(into, targets[i]):
                        landed.add(i)
        wanted = [w for w in wanted if w[0] not in received]
        everyone: list[list[tuple[int, int, int, int, int]]] = [wanted]
        if self.group is not None:
            everyone = [[] for _ in range(dist.get_world_size(self.group))]
            dist.all_gather_object(everyone, wanted, group=self.group)
        transfers = _Transfers()
        tag = 0
        for reader, asks in enumerate(everyone):
            for i, holder, index, start, end in asks:
                tag += 1
                if reader == rank and holder == rank:  # its own memory: read in place, copied into the target
                    received[i] = self._bytes(index, start, end)
                    if _is_target(received[i], targets[i] if targets is not None else []):
                        landed.add(i)  # the target is the held memory itself (`held_boxes`)
                elif holder == rank:
                    transfers.post(dist.isend, self._bytes(index, start, end), dst=reader, group=self.group, tag=tag)
                elif reader == rank:
                    received[i] = self._target(i, end - start, targets)
                    if targets is not None and _is_target(received[i], targets[i]):
                        landed.add(i)
                    transfers.post(dist.irecv, received[i], src=holder, group=self.group, tag=tag)
                    self.moved["group"] += end - start
        try:
            transfers.finish()
        finally:
            allow_peers(False)  # read: no other process needs to attach to this one
        if reads is not None:
            for i, data in received.items():
                _verify(reads.requests[i], data)
        return {i: None if i in landed else data for i, data in received.items()}

    @staticmethod
    def _target(i: int, n: int, targets: list[list[memoryview]] | None) -> torch.Tensor:
        """Where request `i`'s n bytes land: its one target buffer itself (no copy after), or a
        buffer of their own."""
        whole = targets[i] if targets is not None and len(targets[i]) == 1 else None
        if whole is not None and len(whole[0]) == n:
            return torch.frombuffer(whole[0], dtype=torch.uint8)
        return torch.empty(n, dtype=torch.uint8)

    def _bytes(self, index: int, start: int, end: int) -> torch.Tensor:
        """Held bytes [start, end) of box `index`; zeros where this rank does not hold them (the
        holdings every rank planned with came from this rank, so only a bug gets here): raising
        here would leave the reader waiting, its checksums refuse zeros."""
        if self.mine is None or index >= len(self.mine.data) or end > self.mine.data[index].numel():
            return torch.zeros(end - start, dtype=torch.uint8)
        return self.mine.data[index][start:end]


class _Transfers:
    """This rank's point-to-point transfers of an exchange, each posted and waited for even when
    another fails (a peer died): a transfer left unposted would leave its live peer waiting on
    it for the group's whole timeout (a gloo send waits for its receive to be posted), beyond the
    launcher's grace for a failure's survivors, which would then be ended and lose the state
    they hold. The first failure is raised once every transfer has finished or failed."""

    def __init__(self) -> None:
        self.pending: list[Any] = []
        self.error: RuntimeError | None = None

    def post(self, transfer: Any, *args: Any, **kwargs: Any) -> None:
        try:
            self.pending.append(transfer(*args, **kwargs))
        except RuntimeError as error:  # the peer's connection is gone already
            self.error = self.error or error

    def finish(self) -> None:
        for work in self.pending:
            try:
                work.wait()
            except RuntimeError as error:
                self.error = self.error or error
        if self.error is not None:
            raise self.error


def _is_target(data: torch.Tensor, targets: list[memoryview]) -> bool:
    """Whether `data` already is the one buffer its request lands in."""
    return (len(targets) == 1 and len(targets[0]) == data.numel()
            and torch.frombuffer(targets[0], dtype=torch.uint8).data_ptr() == data.data_ptr())


def _verify(request: Request, data: torch.Tensor) -> None:
    view = tensor_bytes(data)
    for offset, n, expected in request.checks:
        actual = crc32c(view[offset : offset + n])
        if actual != expected:
            raise LiveVerificationFailed(str(ChecksumMismatch(request.object, request.start + offset,
                                                              request.start + offset + n, f"{expected:08x}",
                                                              f"{actual:08x}")))
