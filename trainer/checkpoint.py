"""The one checkpoint component: training state <-> a parallelizable tensor collection in storage.

Everything checkpointed is a named global tensor: parameters (`model/...`), optimizer state
(`optim/<param>/<key>`) and each rank's RNG state (`rng/rank<r>/<device>`). The data position
travels in the manifest. Each rank writes only the boxes the layout assigns to it (replicas
once); rank 0 commits the manifest last. Restore walks committed checkpoints newest first and
takes the first one whose every slice passes its checksum on every rank.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ptc import Layout, Slice, assemble_region, bytes_to_tensor, dtype_name, tensor_to_bytes
from ptc.codec import torch_dtype
from ptc.layout import data_parallel_layout
from storage import CheckpointStore, Manifest, ObjectRecord, SliceKey, SliceRecord, StorageError, TensorRecord

log = logging.getLogger("parashift.checkpoint")


def _dist_ready() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rng_state_names(rank: int, device: torch.device) -> dict[str, torch.Tensor]:
    states = {f"rng/rank{rank:05d}/cpu": torch.get_rng_state()}
    if device.type == "cuda":
        states[f"rng/rank{rank:05d}/cuda"] = torch.cuda.get_rng_state(device)
    return states


def collect_state(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int, device: torch.device) -> dict[str, torch.Tensor]:
    """The training state as named global tensors (for data parallel: whole tensors)."""
    names = {param: name for name, param in model.named_parameters()}
    state: dict[str, torch.Tensor] = {f"model/{name}": p.detach() for name, p in model.named_parameters()}
    for param, param_state in optimizer.state.items():
        for key, value in param_state.items():
            if torch.is_tensor(value):
                state[f"optim/{names[param]}/{key}"] = value.detach()
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


def _box(tensor: torch.Tensor, box: Slice) -> torch.Tensor:
    return tensor[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.lengths, strict=True))]


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
    """Whole global tensors `names` from a committed checkpoint, checksums verified, in one
    batched ranged read."""
    wanted = [manifest.tensors[name] for name in names]
    records = [rec for tr in wanted for rec in tr.slices]
    payloads = iter(store.read_slices(manifest.step, records))
    out: dict[str, torch.Tensor] = {}
    for tr in wanted:
        pieces = [bytes_to_tensor(next(payloads), tr.dtype, rec.lengths) for rec in tr.slices]
        stored = [Slice(tuple(r.offsets), tuple(r.lengths)) for r in tr.slices]
        out[tr.name] = assemble_region(
            Slice.whole(tuple(tr.shape)), stored, lambda idx, pieces=pieces: [pieces[i] for i in idx], torch_dtype(tr.dtype)
        )
    return out


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


def restore_latest(store: CheckpointStore, rank: int, world_size: int) -> Restored | None:
    """The newest committed checkpoint that every rank reads intact, or None to start fresh.
    A checkpoint that fails a checksum anywhere is skipped (and kept, for inspection)."""
    for step in reversed(_committed_steps(store, rank, world_size)):
        restored = None
        try:
            manifest = store.load_manifest(step)
            own_rng = f"rng/rank{rank:05d}/"
            names = [n for n in manifest.tensors if not n.startswith("rng/") or n.startswith(own_rng)]
            restored = Restored(step, dict(manifest.data_position), load_tensors(store, manifest, names), manifest)
        except (StorageError, ValueError, KeyError) as error:
            log.warning("rank %d: checkpoint at step %d is unusable (%s); trying an older one", rank, step, error)
        if _agree(restored is not None, world_size):
            return restored
        log.warning("checkpoint at step %d refused by at least one rank; trying an older one", step)
    return None


def apply_state(restored: Restored, model: nn.Module, optimizer: torch.optim.Optimizer, rank: int, device: torch.device) -> None:
    """Copy restored tensors into the live model, optimizer and RNGs."""
    tensors = restored.tensors
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(tensors[f"model/{name}"])
    state_dict = optimizer.state_dict()
    index = {name: i for i, name in enumerate(n for group in optimizer.param_groups for n in _group_names(group, params))}
    opt_state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        if key.startswith("optim/"):
            pname, skey = key[len("optim/") :].rsplit("/", 1)
            opt_state.setdefault(index[pname], {})[skey] = value
    state_dict["state"] = opt_state
    optimizer.load_state_dict(state_dict)
    cpu_rng = tensors.get(f"rng/rank{rank:05d}/cpu")
    if cpu_rng is not None:
        torch.set_rng_state(cpu_rng)
    cuda_rng = tensors.get(f"rng/rank{rank:05d}/cuda")
    if cuda_rng is not None and device.type == "cuda":
        torch.cuda.set_rng_state(cuda_rng, device)


def _group_names(group: dict[str, Any], params: dict[str, nn.Parameter]) -> list[str]:
    by_id = {id(p): n for n, p in params.items()}
    return [by_id[id(p)] for p in group["params"]]
