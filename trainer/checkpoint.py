"""The one checkpoint component: training state <-> a parallelizable tensor collection in storage.

Everything checkpointed is a named global tensor: parameters (`model/...`), optimizer state
(`optim/<param>/<key>`) and each rank's RNG state (`rng/rank<r>/<device>`). The data position
travels in the manifest. Under tensor/pipeline/FSDP plans a rank holds DTensor shards: its box
of each global tensor comes from the placements (`ptc.dtensor`), the Layout from every rank's
boxes. Each rank writes only the boxes the layout assigns to it (replicas once); rank 0
commits the manifest last. Restore walks committed checkpoints newest first and takes the first
one whose every needed slice passes its checksum on every rank; each rank assembles exactly its
boxes under the current plan from whatever boxes were stored (`ptc.assemble_region`), so a
checkpoint saved under one plan restores under any other.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ptc import Layout, Slice, assemble_region, bytes_to_tensor, dtype_name, intersect, tensor_to_bytes
from ptc.codec import torch_dtype
from ptc.dtensor import Holdings, holdings, layout_from_holdings, local_box, local_data
from ptc.layout import data_parallel_layout
from storage import CheckpointStore, Manifest, ObjectRecord, SliceKey, SliceRecord, StorageError, TensorRecord
from trainer.optim import LocalShardAdamW

log = logging.getLogger("parashift.checkpoint")


def _dist_ready() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rng_state_names(rank: int, device: torch.device) -> dict[str, torch.Tensor]:
    states = {f"rng/rank{rank:05d}/cpu": torch.get_rng_state()}
    if device.type == "cuda":
        states[f"rng/rank{rank:05d}/cuda"] = torch.cuda.get_rng_state(device)
    return states


def collect_state(model: nn.Module, optimizer: LocalShardAdamW, rank: int, device: torch.device) -> dict[str, torch.Tensor]:
    """The training state as named global tensors: whole tensors, or DTensors whose local
    shard is this rank's box."""
    state: dict[str, torch.Tensor] = {f"model/{name}": p.detach() for name, p in model.named_parameters()}
    state.update({f"optim/{key}": value for key, value in optimizer.state_tensors().items()})
    state.update(_rng_state_names(rank, device))
    return state


def state_layout(state: dict[str, torch.Tensor], world_size: int) -> Layout:
    """Data-parallel layout of a state: all ranks hold everything but other ranks' RNG states,
    whose shapes equal this rank's (one generator kind per device type)."""
    shapes = {n: (tuple(t.shape), dtype_name(t.dtype)) for n, t in state.items() if not n.startswith("rng/")}
    rank_local: dict[str, int] = {}
    for name, tensor in state.items():
        if name.startswith("rng/"):
            kind = name.rsplit("/", 1)[1]
            for r in range(world_size):
                other = f"rng/rank{r:05d}/{kind}"
                shapes[other] = (tuple(tensor.shape), dtype_name(tensor.dtype))
                rank_local[other] = r
    return data_parallel_layout(shapes, world_size, rank_local)


def gathered_layout(state: dict[str, torch.Tensor], world_size: int) -> Layout:
    """The Layout of the live state: every rank's boxes, exchanged over the process group (a
    pipeline stage does not know the other stages' tensors)."""
    mine = holdings(state)
    per_rank: list[Any] = [mine]
    if _dist_ready() and world_size > 1:
        per_rank = [None] * world_size
        dist.all_gather_object(per_rank, mine)
    return layout_from_holdings(per_rank)


def _box(tensor: torch.Tensor, box: Slice) -> torch.Tensor:
    """The elements of `box` from a tensor this rank holds (its local shard for a DTensor)."""
    _, own = local_box(tensor)
    local = local_data(tensor)
    return local[tuple(slice(o - w, o - w + n) for o, w, n in zip(box.offsets, own.offsets, box.lengths, strict=True))]


def save_checkpoint(
    store: CheckpointStore,
    step: int,
    state: dict[str, torch.Tensor],
    layout: Layout,
    rank: int,
    world_size: int,
    data_position: dict[str, int],
    plan: dict[str, Any],
    metadata: dict[str, Any],
    keep: int,
) -> str | None:
    """Write this rank's boxes; rank 0 commits the manifest once every rank has written.
    Returns the manifest URL on rank 0 (None elsewhere)."""
    payloads = []
    for name, box in layout.slices_to_write(rank):
        payloads.append((SliceKey(tensor=name, offsets=box.offsets, lengths=box.lengths), tensor_to_bytes(_box(state[name], box))))
    obj, records = store.write_rank_object(step, rank, payloads)
    mine = (obj.model_dump() if obj is not None else None, [r.model_dump() for r in records])
    gathered: list[Any] = [mine]
    if _dist_ready() and world_size > 1:
        # Metadata between live ranks over the process group; nothing here touches storage.
        gathered = [None] * world_size
        dist.all_gather_object(gathered, mine)
    url = None
    if rank == 0:
        objects = {}
        slices_by_tensor: dict[str, list[SliceRecord]] = {}
        for obj_dict, record_dicts in gathered:
            if obj_dict is not None:
                record = ObjectRecord(**obj_dict)
                objects[record.key] = record
            for rd in record_dicts:
                slice_record = SliceRecord(**rd)
                slices_by_tensor.setdefault(slice_record.tensor, []).append(slice_record)
        tensors = {
            name: TensorRecord(name=name, dtype=tl.dtype, shape=list(tl.shape), slices=slices_by_tensor.get(name, []))
            for name, tl in layout.tensors.items()
        }
        manifest = Manifest(
            job_id=store.job_id,
            step=step,
            created_at=datetime.now(UTC).isoformat(),
            world_size=world_size,
            data_position=data_position,
            plan=plan,
            tensors=tensors,
            objects=objects,
            metadata=metadata,
        )
        url = store.commit(manifest)
        pruned = store.prune(keep)
        if pruned:
            log.info("pruned checkpoints %s", pruned)
    if _dist_ready() and world_size > 1:
        dist.barrier()  # nobody moves on (or exits) before the manifest is committed
    return url


@dataclass
class Restored:
    step: int
    data_position: dict[str, int]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    manifest: Manifest | None = None


def load_tensors(store: CheckpointStore, manifest: Manifest, names: list[str]) -> dict[str, torch.Tensor]:
    """Whole global tensors `names` from a committed checkpoint, checksums verified."""
    return load_regions(store, manifest, {name: Slice.whole(tuple(manifest.tensors[name].shape)) for name in names})


def load_regions(store: CheckpointStore, manifest: Manifest, wanted: dict[str, Slice]) -> dict[str, torch.Tensor]:
    """The `wanted` box of each named global tensor, assembled from the stored boxes that
    overlap it (only those are read, in one batched ranged read), checksums verified."""
    plan: list[tuple[str, Slice, list[SliceRecord]]] = []
    for name, box in wanted.items():
        tr = manifest.tensors[name]
        overlapping = [r for r in tr.slices if intersect(box, Slice(tuple(r.offsets), tuple(r.lengths))) is not None]
        plan.append((name, box, overlapping))
    payloads = iter(store.read_slices(manifest.step, [rec for _, _, recs in plan for rec in recs]))
    out: dict[str, torch.Tensor] = {}
    for name, box, recs in plan:
        tr = manifest.tensors[name]
        pieces = [bytes_to_tensor(next(payloads), tr.dtype, rec.lengths) for rec in recs]
        stored = [Slice(tuple(r.offsets), tuple(r.lengths)) for r in recs]
        out[name] = assemble_region(box, stored, lambda idx, pieces=pieces: [pieces[i] for i in idx], torch_dtype(tr.dtype))
    return out


def regions_for(manifest: Manifest, own: Holdings, rank: int) -> dict[str, Slice]:
    """What this rank needs from a checkpoint under the current plan: its box of each of its
    parameters, the same box of their optimizer state (whole, for scalars such as Adam's
    step), and its own RNG states."""
    wanted: dict[str, Slice] = {}
    for name, tr in manifest.tensors.items():
        if name.startswith("model/") and name in own:
            wanted[name] = own[name][2]
        elif name.startswith("optim/"):
            param = "model/" + name[len("optim/") :].rsplit("/", 1)[0]
            if param in own:
                same_shape = tuple(tr.shape) == tuple(own[param][0])
                wanted[name] = own[param][2] if same_shape else Slice.whole(tuple(tr.shape))
        elif name.startswith(f"rng/rank{rank:05d}/"):
            wanted[name] = Slice.whole(tuple(tr.shape))
    missing = sorted(n for n in own if n.startswith("model/") and n not in wanted)
    if missing:
        raise KeyError(f"checkpoint at step {manifest.step} lacks {missing[:3]}")
    return wanted


def _agree(ok: bool, world_size: int) -> bool:
    if not (_dist_ready() and world_size > 1):
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _committed_steps(store: CheckpointStore, rank: int, world_size: int) -> list[int]:
    steps: list[Any] = [store.committed_steps() if rank == 0 else None]
    if _dist_ready() and world_size > 1:
        dist.broadcast_object_list(steps, src=0)
    return list(steps[0])


def restore_latest(store: CheckpointStore, rank: int, world_size: int, own: Holdings | None = None) -> Restored | None:
    """The newest committed checkpoint that every rank reads intact, or None to start fresh.
    A checkpoint that fails a checksum anywhere is skipped (and kept, for inspection).
    `own`: this rank's boxes of its parameters under the current plan (None: whole tensors)."""
    for step in reversed(_committed_steps(store, rank, world_size)):
        restored = None
        try:
            manifest = store.load_manifest(step)
            if own is None:
                own_rng = f"rng/rank{rank:05d}/"
                names = [n for n in manifest.tensors if not n.startswith("rng/") or n.startswith(own_rng)]
                tensors = load_tensors(store, manifest, names)
            else:
                tensors = load_regions(store, manifest, regions_for(manifest, own, rank))
            restored = Restored(step, dict(manifest.data_position), tensors, manifest)
        except (StorageError, ValueError, KeyError) as error:
            log.warning("rank %d: checkpoint at step %d is unusable (%s); trying an older one", rank, step, error)
        if _agree(restored is not None, world_size):
            return restored
        log.warning("checkpoint at step %d refused by at least one rank; trying an older one", step)
    return None


def apply_state(restored: Restored, model: nn.Module, optimizer: LocalShardAdamW, rank: int, device: torch.device) -> None:
    """Copy restored tensors (this rank's boxes) into the live model, optimizer and RNGs."""
    tensors = restored.tensors
    with torch.no_grad():
        for name, param in model.named_parameters():
            local_data(param).copy_(tensors[f"model/{name}"])
    optimizer.load_state_tensors({k[len("optim/") :]: v for k, v in tensors.items() if k.startswith("optim/")})
    cpu_rng = tensors.get(f"rng/rank{rank:05d}/cpu")
    if cpu_rng is not None:
        torch.set_rng_state(cpu_rng)
    cuda_rng = tensors.get(f"rng/rank{rank:05d}/cuda")
    if cuda_rng is not None and device.type == "cuda":
        torch.cuda.set_rng_state(cuda_rng, device)

