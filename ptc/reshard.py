"""From a committed manifest and a Layout to a ReconfigPlan, before any process starts: which
checkpoint the workers would restore (`check_usable`, the one rule that the planning here and
the restore in `trainer.checkpoint` share, so they always choose the same checkpoint), every
new rank's reads, their totals, and what each node's local tier serves.

Arithmetic on a manifest: nothing here needs torch.distributed, so the planning before a launch
(`tasks.reshard`, `tasks.plan`, `parashift reshard-plan`) loads no process-group runtime.

It reads storage's own types (`Manifest`, `CheckpointStore`) rather than plain records of its
own: the manifest is the checkpoint's schema, owned by storage, and a second record type would
be one more copy of it to keep in step. The dependency runs one way: storage deals in bytes and
never imports ptc.
"""

from __future__ import annotations

import logging
from math import prod

from parashift.ptc.chunks import row_bytes
from parashift.ptc.codec import torch_dtype
from parashift.ptc.layout import Layout, Slice
from parashift.ptc.reconfig import (
    RankReads,
    ReconfigPlan,
    StoredBox,
    rank_reads,
    reconfig_plan,
    with_live_copies,
)
from parashift.storage import (
    CheckpointNotFound,
    CheckpointStore,
    Manifest,
    ObjectStore,
    StorageError,
    TransientStorageError,
    holding_object_name,
)

# The checkpoint component's log: a refusal at planning reads like the restore's.
log = logging.getLogger("parashift.checkpoint")

# What a restore refuses a checkpoint for (it is then skipped for an older one), and the
# planning with it. A manifest comes from storage, so any of these may follow from one written
# wrongly or tampered with.
REFUSALS = (StorageError, ValueError, KeyError, IndexError, TypeError, OverflowError, RuntimeError)


def check_matches(manifest: Manifest, layout: Layout) -> None:
    """Refuse (ValueError) a checkpoint that is not of this job's state: every parameter and
    optimizer tensor of the layout present with the same global shape and dtype, nothing else
    but RNG states (other rank counts have other ones)."""
    step = manifest.step
    trained = {n: t for n, t in layout.tensors.items() if not n.startswith("rng/")}
    missing = sorted(set(trained) - set(manifest.tensors))
    if missing:
        raise ValueError(f"checkpoint at step {step} lacks {len(missing)} tensors of this job, e.g. {missing[:3]}")
    foreign = sorted(n for n in manifest.tensors if n not in trained and not n.startswith("rng/"))
    if foreign:
        raise ValueError(f"checkpoint at step {step} holds {len(foreign)} tensors this job does not have, e.g. {foreign[:3]}")
    for name, mine in sorted(trained.items()):
        stored = manifest.tensors[name]
        if tuple(stored.shape) != mine.shape or stored.dtype != mine.dtype:
            raise ValueError(f"checkpoint at step {step}: {name} is {stored.dtype}{stored.shape}, "
                             f"this job's is {mine.dtype}{list(mine.shape)}")


def check_usable(manifest: Manifest, layout: Layout,
                 store: CheckpointStore | None = None) -> tuple[dict[str, list[StoredBox]], dict[str, str]]:
    """Refuse (ValueError or StorageError, one line) a checkpoint that cannot be restored into
    `layout`, from its manifest alone: the one rule a restore (`trainer.checkpoint.
    restore_latest`) and the planning before a launch (`reshard_plan`) share, so they always
    choose the same checkpoint.

    Refused: another job's state (`check_matches`); a tensor both hold (RNG states included)
    with another shape or dtype; one the layout does not hold (another rank count's RNG
    state) larger than the layout's largest tensor; slices outside their tensor or not
    matching their bytes (`stored_boxes`); an object whose slices do not add up to its size;
    with `store`, an object that resolves outside the store (a symbolic link). The manifest's
    digest and schema were checked when it was parsed. Returns its `stored_boxes`, for the
    reads that follow."""
    check_matches(manifest, layout)
    step = manifest.step
    largest = max((prod(t.shape) * t.itemsize for t in layout.tensors.values()), default=0)
    for name, stored in manifest.tensors.items():
        mine = layout.tensors.get(name)
        if mine is not None and (tuple(stored.shape) != mine.shape or stored.dtype != mine.dtype):
            raise ValueError(f"checkpoint at step {step}: {name} is {stored.dtype}{stored.shape}, "
                             f"this job's is {mine.dtype}{list(mine.shape)}")
        nbytes = prod(stored.shape) * torch_dtype(stored.dtype).itemsize
        if mine is None and nbytes > largest:
            raise ValueError(f"checkpoint at step {step}: {name} is {stored.dtype}{stored.shape}, {nbytes:,} bytes: "
                             f"larger than any tensor of this job ({largest:,} bytes)")
    boxes = stored_boxes(manifest)
    filled = dict.fromkeys(manifest.objects, 0)
    for record in manifest.all_slices():
        filled[record.object] += record.nbytes
    for key, obj in manifest.objects.items():
        if filled[key] != obj.nbytes:
            raise ValueError(f"checkpoint at step {step}: object {key} is recorded as {obj.nbytes:,} bytes, "
                             f"its slices hold {filled[key]:,}")
    if store is not None:  # what a read would refuse, found without reading
        for key in manifest.objects:
            store.store.check_key(store.paths.ckpt_object(step, key))
    return boxes


def stored_boxes(manifest: Manifest) -> tuple[dict[str, list[StoredBox]], dict[str, str]]:
    """The manifest's slices as ptc sees them, and every tensor's dtype. A slice outside its
    tensor, or whose bytes do not match its box, is refused (ValueError) before anything is
    read or allocated."""
    boxes: dict[str, list[StoredBox]] = {}
    for name, t in manifest.tensors.items():
        itemsize = torch_dtype(t.dtype).itemsize
        boxes[name] = []
        for s in t.slices:
            box = Slice(tuple(s.offsets), tuple(s.lengths))
            inside = len(box.offsets) == len(t.shape) and all(
                o >= 0 and n > 0 and o + n <= size for o, n, size in zip(box.offsets, box.lengths, t.shape, strict=True))
            if not inside or s.nbytes != box.numel * itemsize:
                raise ValueError(f"checkpoint at step {manifest.step}: a slice of {name} ({s.offsets}+{s.lengths}, "
                                 f"{s.nbytes} bytes) does not fit a {t.dtype}{t.shape} tensor")
            per_row = row_bytes(box, tuple(s.dim_order), itemsize)
            chunks = tuple(s.chunks)  # (nbytes, crc) pairs of ints, as the manifest's schema parsed them
            if any(n % per_row for n, _ in chunks):
                raise ValueError(f"checkpoint at step {manifest.step}: chunks of {name} are not whole rows")
            boxes[name].append(StoredBox(name, box, tuple(s.dim_order), s.object, s.byte_offset, chunks,
                                         tuple((str(o), int(at)) for o, at in s.copies)))
    return boxes, {name: t.dtype for name, t in manifest.tensors.items()}


def node_objects(tier: ObjectStore | None, store: CheckpointStore, step: int) -> frozenset[str]:
    """The objects of `step` this node's tier holds."""
    if tier is None:
        return frozenset()
    folder = store.paths.ckpt_dir(step)
    return frozenset(key[len(folder) + 1 :] for key in tier.list(folder))


def reads_for(manifest: Manifest, wanted: dict[str, Slice], rank: int, local: frozenset[str] = frozenset(),
              live: dict[int, list[tuple[str, Slice, tuple[int, ...]]]] | None = None,
              stored: tuple[dict[str, list[StoredBox]], dict[str, str]] | None = None) -> RankReads:
    """One rank's reads of the boxes it `wanted` (tensor -> box) from the checkpoint `manifest`
    describes; objects in `local` are read from the node's tier, boxes that `live` ranks hold
    (rank -> its boxes) from their memory. `stored`: the manifest's `stored_boxes`, where
    `check_usable` has computed them already."""
    boxes, dtypes = stored if stored is not None else stored_boxes(manifest)
    if live:
        boxes, held = with_live_copies(boxes, live, rank)
        local = local | held
    return rank_reads(boxes, dtypes, wanted, rank, local)


def reshard_plan(store: CheckpointStore, layout: Layout, manifest: Manifest | None = None,
                 tier: ObjectStore | None = None, nodes: list[str] | None = None) -> ReconfigPlan | None:
    """What every rank of `layout` would read from the newest checkpoint the workers would
    restore (or the given one): computed from the manifests alone, before any process starts.
    None when nothing usable is committed.

    A checkpoint the workers would refuse before reading it (`check_usable`: its manifest's
    digest or schema, another shape or dtype than the job's, slices that do not fit, objects
    outside the store, reads that do not cover a rank's boxes) is skipped for an older one,
    with one WARNING line, as `restore_latest` skips it: the plan and the workers agree.

    Where each read comes from: on one node (`nodes` None), the objects `tier` holds. Across
    `nodes` (node-major ranks, `launcher.launch.NodeRendezvous`) with tiers (`tier` not None:
    any node's, only its presence counts), the objects the manifest says were written on the
    reader's node, which that node's tier keeps (one that lost them is read around at restore
    time, from object storage)."""
    if manifest is not None:
        return _reshard_plan(store, layout, manifest, tier, nodes)
    for step in reversed(store.manifest_steps()):
        try:
            found = store.load_manifest(step)
            check_usable(found, layout, store)
            return _reshard_plan(store, layout, found, tier, nodes)
        except CheckpointNotFound:
            continue  # pruned since the listing
        except TransientStorageError:
            raise
        except REFUSALS as error:
            _say_once(store, step, str(error) or type(error).__name__)
    return None


def _reshard_plan(store: CheckpointStore, layout: Layout, manifest: Manifest, tier: ObjectStore | None,
                  nodes: list[str] | None) -> ReconfigPlan:
    boxes, dtypes = stored_boxes(manifest)
    world = layout.world_size
    if nodes is None:
        local = node_objects(tier, store, manifest.step)
        return reconfig_plan(manifest.step, boxes, dtypes, layout, {r: local for r in range(world)})
    written = manifest.metadata.get("nodes")
    on_node: dict[str, set[str]] = {}
    if tier is not None and isinstance(written, list):
        for old_rank, node in enumerate(written):
            on_node.setdefault(str(node), set()).add(holding_object_name(old_rank))
    per_node = max(1, world // len(nodes))
    local_objects = {r: frozenset(on_node.get(nodes[min(r // per_node, len(nodes) - 1)], ())) for r in range(world)}
    return reconfig_plan(manifest.step, boxes, dtypes, layout, local_objects)


# (job's store, step, reason) already said by this process's planning: one line per refusal,
# however often a flow plans (each option of the planner, then the reshard summary).
_said: set[tuple[str, int, str]] = set()


def _say_once(store: CheckpointStore, step: int, reason: str) -> None:
    if (repr(store), step, reason) not in _said:
        _said.add((repr(store), step, reason))
        log.warning("planning skips the checkpoint at step %d of %s (the workers would refuse it): %s",
                    step, store.job_id, reason)
