"""Saving: the asynchronous, sharded writer of one rank and the manifest rank 0 commits.

Blocks the training loop only for the snapshot: GPU boxes are copied into reused pinned host
buffers; host boxes are read in place, the loop waiting (if at all) at its next optimizer step
(`before_update`). A background thread streams the boxes the Layout assigns this rank
(replicas once) to storage in stored dim order with a CRC-32C per chunk, the ranks send their
records to rank 0 over a dedicated gloo group, and rank 0 commits the manifest, last, then
prunes. One save is in flight at a time; a failed save is reported at the next `wait` and
never leaves a manifest. When training fails with a save in flight, `abandon` stops it: it
writes nothing more and commits nothing, so nothing of it lands after the job's recovery has
started writing the same step.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import torch
import torch.distributed as dist
from parashift.ptc import Layout, Slice
from parashift.ptc.chunks import chunk_rows, row_bytes, storage_order
from parashift.ptc.codec import tensor_bytes
from parashift.ptc.dtensor import local_data
from parashift.ptc.transpose import copy_across_transpose
from parashift.storage import (
    CheckpointStore,
    LeaseToken,
    Manifest,
    ObjectRecord,
    ObjectStore,
    SliceKey,
    SlicePayload,
    SliceRecord,
    StorageError,
    TensorRecord,
    holding_object_name,
)
from parashift.trainer.checkpoint.group import Group, broadcast

log = logging.getLogger("parashift.checkpoint")

# How long `abandon` waits for the storage change under way to end (a write stops at its next
# chunk; only storage that does not answer takes longer).
ABANDON_WAIT_S = 60.0


class SaveAbandoned(StorageError):
    """The save was abandoned (`Checkpointer.abandon`): training failed while it was in flight."""


@dataclass(frozen=True)
class _BoxToWrite:
    """One box this rank writes, with its stored dim order and checksum chunks (computed once)."""

    name: str
    box: Slice
    order: tuple[int, ...]
    chunk_rows: tuple[int, ...]
    row_bytes: int

    @classmethod
    def of(cls, layout: Layout, name: str, box: Slice) -> _BoxToWrite:
        tensor = layout.tensors[name]
        order = storage_order(len(tensor.shape), tensor.split_dim)
        rows = chunk_rows(tensor.shape, box, order, tensor.itemsize, tensor.split_dim)
        return cls(name, box, order, tuple(rows), row_bytes(box, order, tensor.itemsize))

    @property
    def key(self) -> tuple[str, Slice]:
        return self.name, self.box

    def payload(self, buffer: torch.Tensor, scratch: Callable[[int], torch.Tensor]) -> SlicePayload:
        """The box's stored bytes from `buffer` (natural dim order), chunk by chunk; permuted
        chunks are built in `scratch(nbytes)`, reused memory (a fresh tensor per chunk would
        cost its page faults: half the speed of the copy)."""
        key = SliceKey(self.name, self.box.offsets, self.box.lengths)
        chunk_bytes = tuple(r * self.row_bytes for r in self.chunk_rows)
        if self.order == tuple(range(len(self.order))):
            return SlicePayload.of_bytes(key, self.order, tensor_bytes(buffer), chunk_bytes)
        starts = [0, *itertools.accumulate(self.chunk_rows)]
        outer = self.order[0]

        def chunk(i: int) -> memoryview:  # rows of the outer stored dim, laid out in stored order
            part = buffer.narrow(outer, starts[i], starts[i + 1] - starts[i]).permute(self.order)
            out = scratch(chunk_bytes[i])[: chunk_bytes[i]].view(buffer.dtype).view(part.shape)
            copy_across_transpose(out, part)
            return tensor_bytes(out)

        return SlicePayload(key, self.order, chunk_bytes, chunk)


@dataclass
class SaveReport:
    """What one save cost: the loop's stall, and the background write + commit."""

    step: int
    stall_s: float
    bytes_written: int = 0  # this rank's object
    write_s: float = 0.0
    url: str | None = None
    bytes_total: int = 0  # rank 0, once committed: every rank's object, the checkpoint's size
    ranks: int = 0  # rank 0, once committed: the ranks that wrote an object


NO_SPACE = "no space left on device: "  # how a rank tells rank 0 its save found the disk full


class CheckpointWriteFailed(StorageError):
    """A save of step `step` that committed nothing; `no_space`: because the store's disk is
    full (a retry would write into the same full disk)."""

    def __init__(self, step: int, message: str, no_space: bool = False) -> None:
        super().__init__(message)
        self.step, self.no_space = step, no_space


def out_of_space(error: BaseException | None) -> bool:
    """Whether `error` or anything that caused it is a full disk or an exceeded quota."""
    seen = 0
    while error is not None and seen < 20:
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        error, seen = error.__cause__ or error.__context__, seen + 1
    return False


def failed_write(error: BaseException | None) -> CheckpointWriteFailed | None:
    """The failed save in `error`'s chain, if a failed save is what it is."""
    seen = 0
    while error is not None and seen < 20:
        if isinstance(error, CheckpointWriteFailed):
            return error
        error, seen = error.__cause__ or error.__context__, seen + 1
    return None


class Checkpointer:
    """Asynchronous, sharded saves of one rank under one Layout.

    What the loop waits for: GPU tensors are copied into pinned host buffers at `save` (the
    device-to-host snapshot). Host tensors are not copied at all by default: the background
    write reads them where they are, and the loop must call `before_update()` before it next
    changes them (the optimizer step), which waits until the write has consumed their bytes.
    The write overlaps the next forward and backward pass, as CheckFreq pipelines its
    snapshot; a write slower than that pass shows up as waiting in `before_update`.
    `copy_host_memory=True` copies host tensors at `save` instead (no wait later).
    """

    def __init__(
        self,
        store: CheckpointStore,
        layout: Layout,
        rank: int,
        group: Group = None,
        keep: int = 2,
        on_commit: Callable[[SaveReport], None] | None = None,
        tier: ObjectStore | None = None,
        copy_host_memory: bool = False,
        tier_budget_bytes: int | None = None,
        resumed_from: Manifest | None = None,
        resumed_pending: bool = False,
    ) -> None:
        self.store, self.layout, self.rank, self.group, self.keep = store, layout, rank, group, keep
        self.on_commit = on_commit
        self.tier = tier
        self.tier_budget_bytes = tier_budget_bytes
        self.world_size = layout.world_size
        self._boxes = [_BoxToWrite.of(layout, name, box) for name, box in layout.slices_to_write(rank)]
        # With a node-local tier: everything this rank holds (its holding object), so that a
        # restore on this node finds every box its ranks had, whichever rank stored it.
        self._held = [_BoxToWrite.of(layout, name, box) for name, box in sorted(layout.boxes_of(rank).items())]
        self._buffers: dict[tuple[str, Slice], torch.Tensor] = {}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="parashift-save")
        # Pruning reads the manifests it keeps (~0.1 s): on its own thread, so the next save's
        # write never queues behind it. It deletes only steps below the newest committed one,
        # and a save in flight is always above that.
        self._pruner = ThreadPoolExecutor(1, thread_name_prefix="parashift-prune")
        self._inflight: Future[SaveReport] | None = None
        # Set by `abandon`; checked before each chunk and each storage change. The lock is held
        # by whatever changes storage (`_storage_change`: a set-aside, a write, a commit, a
        # prune), so that `abandon` returns only once none is under way.
        self._abandoned = threading.Event()
        self._changing_storage = threading.Lock()
        self._consumed = threading.Event()  # set: the save in flight no longer reads live memory
        self._consumed.set()
        self._current: SaveReport | None = None
        self.copy_host_memory = copy_host_memory
        self._chunk_buffer = torch.empty(0, dtype=torch.uint8)
        self.last_stall_s: float | None = None  # the loop's wait for the newest save: capture + before_update
        # (newest step of this training's lineage, the one before it): each manifest names the
        # checkpoint its training continued from, which is what retention keeps. A pending
        # manifest (`resumed_pending`: a step restored from live ranks' memory) is no checkpoint:
        # the lineage goes on from the commit it continues.
        self._lineage: tuple[int | None, int | None] = (None, None)
        if resumed_from is not None:
            self._lineage = ((resumed_from.previous_step, None) if resumed_pending
                             else (resumed_from.step, resumed_from.previous_step))
        # Steps committed before this writer started (its restore's choice left the newer ones) and
        # its own commits: a commit continues the newest committed step but these (`CheckpointStore.commit`).
        self._known = set(store.manifest_steps()) if rank == 0 else set()

    def save(self, step: int, state: dict[str, torch.Tensor], data_position: dict[str, int], plan: dict[str, Any],
             metadata: dict[str, Any], *, blocking: bool = False) -> SaveReport:
        """Snapshot this rank's boxes now; write and commit them in the background (after the
        previous save has finished). `blocking`: also wait for the commit."""
        self.wait()
        started = time.perf_counter()
        payloads, live = self._capture(state, copy_host=self.copy_host_memory)
        report = SaveReport(step, time.perf_counter() - started)
        self._current = report
        self._consumed = threading.Event()
        if not live:
            self._consumed.set()
        self._inflight = self._pool.submit(self._write_and_commit, report, payloads, data_position, plan, metadata,
                                           self._consumed)
        if blocking:
            self.wait()
        return report

    def write_pending(self, step: int, state: dict[str, torch.Tensor], data_position: dict[str, int],
                      plan: dict[str, Any], metadata: dict[str, Any]) -> str:
        """At a planned change on warm workers: describe this step as a save would (the same
        records, CRCs computed from memory) and store that as a pending manifest, instead of
        writing the bytes. The ranks keep the state (`live.hold`), the next segment restores it
        from their memory and saves it under its plan. A collective on the checkpoint's group,
        after the save in flight has committed; raises StorageError on every rank if any failed
        (the caller saves as usual then). Returns the pending manifest's URL."""
        self.wait()
        payloads, _ = self._capture(state, copy_host=False, boxes=self._boxes)
        error, obj, records = None, None, []
        try:
            obj, records = self.store.pending_records(self.rank, payloads)
        except Exception as exc:  # noqa: BLE001 - every rank hears it below
            error = exc
        mine = (repr(error) if error else None, obj.model_dump() if obj else None, [r.model_dump() for r in records])
        gathered = [mine]
        if self.group is not None:
            gathered = [None] * self.world_size if self.rank == 0 else None
            dist.gather_object(mine, gathered, dst=0, group=self.group)
        outcome: tuple[str | None, str | None] = (None, None)  # (url, problem)
        if self.rank == 0:
            failed = [f"rank {r}: {e}" for r, (e, _, _) in enumerate(gathered) if e]
            if failed:
                outcome = (None, "; ".join(failed))
            else:
                last, before = self._lineage
                manifest = build_manifest(
                    self.store.job_id, step, self.layout, [ObjectRecord(**o) for _, o, _ in gathered if o is not None],
                    [SliceRecord(**r) for _, _, rs in gathered for r in rs], data_position, plan, metadata,
                    previous_step=before if last == step else last)
                try:
                    outcome = (self.store.write_pending(manifest, fence=LeaseToken.from_env()), None)
                except Exception as exc:  # noqa: BLE001 - every rank hears it
                    outcome = (None, str(exc) or type(exc).__name__)
        url, problem = broadcast(outcome, self.group)
        if problem is not None:
            raise StorageError(f"pending manifest of step {step} not written: {problem}")
        return url

    def _scratch(self, nbytes: int) -> torch.Tensor:
        """Reused memory for one permuted chunk at a time (the writer consumes each chunk before
        it asks for the next)."""
        if self._chunk_buffer.numel() < nbytes:
            self._chunk_buffer = torch.empty(nbytes, dtype=torch.uint8)
        return self._chunk_buffer

    def before_update(self) -> float:
        """Wait until the save in flight has stopped reading live tensors; call it before
        changing them (the optimizer step). Returns the seconds waited (added to the stall)."""
        current, self._current = self._current, None
        waited = 0.0
        if not self._consumed.is_set():
            started = time.perf_counter()
            self._consumed.wait()
            waited = time.perf_counter() - started
        if current is not None:
            current.stall_s += waited
            self.last_stall_s = current.stall_s
        return waited

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed; raise what made it fail."""
        inflight, self._inflight = self._inflight, None
        if inflight is not None:
            inflight.result()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)
            self._pruner.shutdown(wait=True)

    def abandon(self, timeout_s: float = ABANDON_WAIT_S) -> bool:
        """Training failed (a peer died, say): the save in flight, if any, writes nothing more
        and commits nothing, and no prune runs. Without this, a warm worker serves the job's
        recovery while the failed segment's save thread goes on: its late rename (or upload
        completion) could replace an object of the same name that the recovery writes when
        it saves that step again. Returns once nothing of this writer is changing storage
        (False: still after `timeout_s`, said in a warning). No collective is entered: the
        peers may be gone."""
        self._abandoned.set()
        self._inflight = None
        stopped = self._changing_storage.acquire(timeout=timeout_s)
        if stopped:
            self._changing_storage.release()
        else:
            log.warning("rank %d: the abandoned save still changes storage after %.0f s", self.rank, timeout_s)
        self._consumed.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._pruner.shutdown(wait=False, cancel_futures=True)
        return stopped

    @contextlib.contextmanager
    def _storage_change(self, what: str) -> Iterator[None]:
        """Around each change of storage (a write, a set-aside, a commit, a prune): none begins
        once the writer is abandoned, and `abandon` waits for the one under way."""
        with self._changing_storage:
            if self._abandoned.is_set():
                raise SaveAbandoned(f"rank {self.rank}: {what} abandoned")
            yield

    def _unless_abandoned(self, payloads: list[SlicePayload]) -> list[SlicePayload]:
        """`payloads` whose every chunk first checks that the save was not abandoned."""
        def checked(chunk: Callable[[int], memoryview | bytes]) -> Callable[[int], memoryview | bytes]:
            def read(i: int) -> memoryview | bytes:
                if self._abandoned.is_set():
                    raise SaveAbandoned(f"rank {self.rank}: save abandoned")
                return chunk(i)
            return read
        return [SlicePayload(p.key, p.dim_order, p.chunk_bytes, checked(p.chunk)) for p in payloads]

    def snapshot(self, state: dict[str, torch.Tensor]) -> list[SlicePayload]:
        """This rank's boxes copied into host buffers (reused from save to save)."""
        return self._capture(state, copy_host=True)[0]

    def _capture(self, state: dict[str, torch.Tensor], copy_host: bool,
                 boxes: list[_BoxToWrite] | None = None) -> tuple[list[SlicePayload], bool]:
        """This rank's boxes as payloads (`boxes`, by default what a save writes): device
        tensors copied into pinned host buffers, host tensors copied too when `copy_host` (else
        read in place: returns live=True). Boxes stored with another dim order are permuted
        chunk by chunk while they are written."""
        payloads = []
        device_copies = live = False
        if boxes is None:
            boxes = self._held if self.tier is not None else self._boxes
        for box in boxes:
            local = local_data(state[box.name]).detach()
            if tuple(local.shape) != box.box.lengths:
                raise ValueError(f"{box.name}: this rank holds {list(local.shape)}, its layout box is {list(box.box.lengths)}")
            if not copy_host and local.device.type == "cpu" and local.is_contiguous():
                payloads.append(box.payload(local, self._scratch))
                live = True
                continue
            buffer = self._buffers.get(box.key)
            if buffer is None or buffer.dtype != local.dtype:
                buffer = torch.empty(box.box.lengths, dtype=local.dtype, pin_memory=local.device.type == "cuda")
                self._buffers[box.key] = buffer
            device_copies |= local.device.type == "cuda"
            buffer.copy_(local, non_blocking=True)
            payloads.append(box.payload(buffer, self._scratch))
        if device_copies:
            torch.cuda.synchronize()
        return payloads, live

    @property
    def host_buffers(self) -> list[torch.Tensor]:
        """The snapshot buffers (for benchmarks: the same bytes, written raw)."""
        return list(self._buffers.values())

    def _write_and_commit(self, report: SaveReport, payloads: list[SlicePayload], data_position: dict[str, int],
                          plan: dict[str, Any], metadata: dict[str, Any], consumed: threading.Event) -> SaveReport:
        started = time.perf_counter()
        step = report.step
        error, obj, records, kept = None, None, [], False
        try:
            # Never write through what is there. The lock is held for rank 0's rename only, not
            # the broadcast after it: a peer that hangs there must not hold `abandon` up.
            _set_aside(self.store, step, self.rank, self.group, self._known,
                       lambda: self._storage_change(f"save of step {step}"))
            with self._storage_change(f"save of step {step}"):
                held = payloads = self._unless_abandoned(payloads)
                if self.tier is not None:  # payloads are the held boxes: the store gets the ones to write
                    by_key = {b.key: p for b, p in zip(self._held, payloads, strict=True)}
                    payloads = [by_key[b.key] for b in self._boxes]
                obj, records = self.store.write_rank_object(step, self.rank, payloads)
                if self.tier is not None:
                    nbytes = sum(sum(p.chunk_bytes) for p in held)
                    if self.tier_budget_bytes is None or 2 * nbytes <= self.tier_budget_bytes:  # two steps kept
                        kept = self._keep_on_node(step, held)
                    else:
                        log.warning("rank %d: %d bytes exceed this rank's share of the local tier; not kept there",
                                    self.rank, nbytes)
        except Exception as exc:  # reported to rank 0 (no commit) and raised here below
            error = exc
        finally:
            consumed.set()  # written (or failed): the loop may change its tensors again
        if self._abandoned.is_set():  # no gather: the peers may be gone
            raise SaveAbandoned(f"rank {self.rank}: save of step {step} abandoned")
        said = None if error is None else (NO_SPACE if out_of_space(error) else "") + repr(error)
        mine = (said, obj.model_dump() if obj else None, [r.model_dump() for r in records], kept)
        gathered = [mine]
        if self.group is not None:
            gathered = [None] * self.world_size if self.rank == 0 else None
            dist.gather_object(mine, gathered, dst=0, group=self.group)
        if error is not None:
            raise CheckpointWriteFailed(step, f"rank {self.rank}: checkpoint at step {step} failed; nothing was "
                                              "committed", no_space=out_of_space(error)) from error
        report.bytes_written = obj.nbytes if obj else 0
        if self.rank == 0:
            failed = [(r, e) for r, (e, _, _, _) in enumerate(gathered) if e]
            if failed:
                raise CheckpointWriteFailed(step, f"checkpoint at step {step} not committed: "
                                            + "; ".join(f"rank {r}: {e}" for r, e in failed),
                                            no_space=any(e.startswith(NO_SPACE) for _, e in failed))
            objects = [ObjectRecord(**o) for _, o, _, _ in gathered if o is not None]
            report.bytes_total, report.ranks = sum(o.nbytes for o in objects), len(objects)
            copies = holding_copies(self.layout, [r for r, (_, _, _, k) in enumerate(gathered) if k])
            records = [SliceRecord(**{**r, "copies": copies.get((r["tensor"], Slice(tuple(r["offsets"]), tuple(r["lengths"]))), [])})
                       for _, _, rs, _ in gathered for r in rs]
            last, before = self._lineage
            previous = before if last == step else last  # a step saved again keeps its link
            manifest = build_manifest(self.store.job_id, step, self.layout, objects, records, data_position, plan, metadata,
                                      previous_step=previous)
            with self._storage_change(f"commit of step {step}"):
                report.url = self.store.commit(manifest, fence=LeaseToken.from_env(), skipped=self._known)
            self._known.add(step)
            self._lineage = (step, previous)
            report.write_s = time.perf_counter() - started
            if self.on_commit is not None:
                self.on_commit(report)
            self._pruner.submit(self._prune, step)  # after the commit is reported: never on the save's path
        else:
            report.write_s = time.perf_counter() - started
        return report

    def _prune(self, newest: int) -> None:
        try:
            with self._storage_change("prune"):
                pruned = self.store.prune(self.keep, newest)
        except SaveAbandoned:
            return
        except StorageError as error:  # the next save prunes again
            log.warning("pruning old checkpoints failed: %s", error)
            return
        if pruned:
            log.info("pruned %s %s (keep_checkpoints: %d)", "checkpoint" if len(pruned) == 1 else "checkpoints",
                     ", ".join(map(str, pruned)), self.keep)

    def _keep_on_node(self, step: int, held: list[SlicePayload]) -> bool:
        """Keep everything this rank holds in the node-local tier (its holding object) for the
        two newest steps it saved: the newest may never be committed (a peer fails first), and
        the one before is then what a restore on this node reads. A tier that fails costs a
        warning, never the save (the store has everything). Returns whether it was kept."""
        assert self.tier is not None
        paths = self.store.paths
        name = holding_object_name(self.rank)
        try:
            self.tier.put_stream(paths.ckpt_object(step, name),
                                 lambda: (p.chunk(i) for p in held for i in range(len(p.chunk_bytes))))
            kept = []
            for key in self.tier.list(paths.ckpt_root):
                folder = key.split("/")[3]
                if folder.isdigit() and key.endswith(name):
                    kept.append((int(folder), key))
            for _, key in sorted(kept)[:-2]:
                self.tier.delete(key)
        except (StorageError, OSError) as error:
            log.warning("rank %d: the node-local tier could not keep step %d: %s", self.rank, step, error)
            return False
        return True


def _set_aside(store: CheckpointStore, step: int, rank: int, group: Group, known: set[int],
               guard: Callable[[], contextlib.AbstractContextManager[None]]) -> None:
    """Before any rank writes `step`: rank 0 sets aside what an earlier save left in its folder
    (`CheckpointStore.set_aside`, fenced by the job's lease like a commit, inside `guard()`);
    every rank hears how that went and fails the save with rank 0 if it failed."""
    error = None
    if rank == 0:
        try:
            with guard():
                store.set_aside(step, fence=LeaseToken.from_env(), skipped=known)
        except Exception as exc:  # noqa: BLE001 - every rank fails this save with it
            error = str(exc) or type(exc).__name__
    error = broadcast(error, group)
    if error is not None:
        raise StorageError(error if rank == 0 else f"rank 0: {error}")


def holding_copies(layout: Layout, ranks: list[int]) -> dict[tuple[str, Slice], list[tuple[str, int]]]:
    """Where each box lies in the holding objects of `ranks` (each: the rank's boxes in name
    order, whole, as a stored box's bytes)."""
    out: dict[tuple[str, Slice], list[tuple[str, int]]] = {}
    for rank in ranks:
        offset = 0
        for name, box in sorted(layout.boxes_of(rank).items()):
            out.setdefault((name, box), []).append((holding_object_name(rank), offset))
            offset += box.numel * layout.tensors[name].itemsize
    return out


HeldRecords = dict[int, tuple[ObjectRecord | None, list[SliceRecord]]]  # rank -> what it would have written


def held_records(store: CheckpointStore, layout: Layout, stored: dict[tuple[str, Slice], torch.Tensor],
                 ranks: Iterable[int]) -> HeldRecords:
    """The records (byte ranges, chunk CRCs) of what each of `ranks` writes in a checkpoint of
    `layout` (`Layout.slices_to_write`), computed from `stored` (every box they write, as its
    stored bytes: uint8, stored dim order) without writing a byte: one CRC pass over those boxes."""
    writers = layout.slices_by_writer()
    out: HeldRecords = {}
    for rank in ranks:
        payloads = []
        for name, box in writers.get(rank, []):
            write = _BoxToWrite.of(layout, name, box)
            key = SliceKey(name, box.offsets, box.lengths)
            payloads.append(SlicePayload.of_bytes(key, write.order, tensor_bytes(stored[name, box]),
                                                  tuple(r * write.row_bytes for r in write.chunk_rows)))
        out[rank] = store.pending_records(rank, payloads)
    return out


def record_shares(layout: Layout, holders: int) -> list[list[int]]:
    """The ranks of `layout` whose writes each of `holders` processes holding the whole state
    describes (`held_records`), balanced by bytes (costliest first, each to the least loaded;
    ties to the lowest): the same on every process, so they split a held step's checksum pass."""
    writes = {r: sum(box.numel * layout.tensors[name].itemsize for name, box in boxes)
              for r, boxes in layout.slices_by_writer().items()}
    shares: list[list[int]] = [[] for _ in range(holders)]
    load = [0] * holders
    for rank in sorted(range(layout.world_size), key=lambda r: (-writes.get(r, 0), r)):
        least = min(range(holders), key=lambda i: (load[i], i))
        shares[least].append(rank)
        load[least] += writes.get(rank, 0)
    return shares


def describe_held(store: CheckpointStore, layout: Layout, step: int, stored: dict[tuple[str, Slice], torch.Tensor],
                  data_position: dict[str, int], plan: dict[str, Any], metadata: dict[str, Any],
                  previous_step: int | None) -> Manifest:
    """The pending manifest of a step one process holds whole: `stored`, every distinct box of
    `layout` as its stored bytes (uint8, stored dim order), described as every rank of
    `layout` would have written it (the same records and CRCs), without writing a byte. What
    the survivors of a failure hold of a replicated state (`trainer.checkpoint.live`)."""
    records = held_records(store, layout, stored, range(layout.world_size))
    return held_manifest(store.job_id, layout, step, records, data_position, plan, metadata, previous_step)


def held_manifest(job_id: str, layout: Layout, step: int, records: HeldRecords, data_position: dict[str, int],
                  plan: dict[str, Any], metadata: dict[str, Any], previous_step: int | None) -> Manifest:
    """The pending manifest of every rank's `held_records` (computed by one holder, or by
    several between them: `record_shares`)."""
    objects, slices = [], []
    for rank in range(layout.world_size):
        obj, mine = records[rank]
        objects += [obj] if obj is not None else []
        slices += mine
    return build_manifest(job_id, step, layout, objects, slices, data_position, plan, metadata, previous_step)


def build_manifest(job_id: str, step: int, layout: Layout, objects: list[ObjectRecord], records: list[SliceRecord],
                   data_position: dict[str, int], plan: dict[str, Any], metadata: dict[str, Any],
                   previous_step: int | None = None) -> Manifest:
    """The manifest of a checkpoint whose every rank has written `objects` holding `records`;
    `previous_step`: the checkpoint its training continued from."""
    slices: dict[str, list[SliceRecord]] = {}
    for record in records:
        slices.setdefault(record.tensor, []).append(record)
    tensors = {name: TensorRecord(name=name, dtype=t.dtype, shape=list(t.shape), slices=slices.get(name, []))
               for name, t in layout.tensors.items()}
    return Manifest(job_id=job_id, step=step, created_at=datetime.now(UTC).isoformat(), world_size=layout.world_size,
                    data_position=data_position, plan=plan, tensors=tensors, objects={o.key: o for o in objects},
                    metadata=metadata, previous_step=previous_step)
