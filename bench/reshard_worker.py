"""One side of `bench.reshard`, run by torchrun on every rank: build a GPT and its AdamW state
under a plan, then either save it (raw write, parashift, DCP) or restore it under another plan
(parashift, DCP) and check that both restores agree. Rank 0 prints one JSON line.

    torchrun --nproc-per-node N -m bench.reshard_worker --phase save|load --plan plan.json ...
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from parashift.models import family_of
from parashift.ptc.dtensor import local_data
from parashift.specs import JobSpec
from parashift.specs.plan import Plan
from parashift.storage import ObjectStore, job_store
from parashift.trainer.checkpoint import Checkpointer, restore_latest
from parashift.trainer.layout import layout_mismatches, state_layout
from parashift.trainer.mesh import Coordinates, ParallelDims
from parashift.trainer.optim import LocalShardAdamW
from parashift.trainer.parallel import materialize, parallelize
from parashift.trainer.pipeline import build_stage
from parashift.trainer.state import apply_state, collect_state, restore_destinations
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter


def build(plan: Plan, spec: JobSpec) -> tuple[torch.nn.Module, LocalShardAdamW]:
    """The rank's part of the model under `plan`, as the trainer builds it, with AdamW state
    after one step."""
    dims = ParallelDims.from_plan(plan)
    mesh = dims.build_mesh("cpu")
    coords = Coordinates.of(mesh, dims)
    family = family_of(spec.model)
    model = family.build_on_meta(spec.model)
    n_layers = spec.model.n_layers
    module = build_stage(model, family, plan, n_layers, coords.pp_rank) if dims.pp > 1 else model
    parallelize(module, family, plan, mesh, plan.tp_regions(n_layers), torch.device("cpu"))
    materialize(module, torch.device("cpu"), lambda name, shape, box: family.initial_part(spec.model, name, shape, box, 0))
    optimizer = LocalShardAdamW(module, spec, torch.device("cpu"))
    for p in module.parameters():
        p.grad = torch.full_like(p, 1e-3)
    optimizer.step()
    optimizer.zero_grad()
    return module, optimizer


def timed(fn: Any, group: Any) -> tuple[float, Any]:
    """Wall seconds of `fn` on the slowest rank (barrier before and after)."""
    dist.barrier(group=group)
    started = time.perf_counter()
    out = fn()
    dist.barrier(group=group)
    return time.perf_counter() - started, out


def total(value: float, group: Any, op: Any = dist.ReduceOp.SUM) -> float:
    t = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(t, op=op, group=group)
    return float(t.item())


def read_bytes_of_process() -> int:
    """Bytes this process has read from files (/proc/self/io rchar: read and pread calls), plus
    what s3fs fetched from S3 (socket reads are not in rchar; counted by `count_s3_reads`)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1]) + S3_FETCHED[0]
    return S3_FETCHED[0]


S3_FETCHED = [0]


def count_s3_reads() -> None:
    """Count the bytes of every ranged GET s3fs's file objects make (DCP reads through them)."""
    import s3fs.core

    fetch = s3fs.core.S3File._fetch_range

    def counted(self: Any, start: int, end: int) -> bytes:
        data = fetch(self, start, end)
        S3_FETCHED[0] += len(data)
        return data

    s3fs.core.S3File._fetch_range = counted


def dcp_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What DCP saves and loads: parameters and optimizer state (RNG states are per rank and
    would not exist for new ranks)."""
    return {k: v for k, v in state.items() if not k.startswith("rng/")}


def raw_write(path: str, views: list[memoryview], store: ObjectStore | None, key: str) -> None:
    """The same bytes, written as plainly as the backend allows: one file + fsync, or one PUT."""
    if store is not None:
        store.put_stream(key, lambda: views)
        return
    with open(path, "wb", buffering=0) as f:
        for view in views:
            f.write(view)
        os.fsync(f.fileno())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--phase", choices=["save", "load"], required=True)
    parser.add_argument("--plan", type=Path, required=True)
    parser.add_argument("--spec", type=Path, required=True)
    parser.add_argument("--dcp", required=True, help="DCP checkpoint folder or URL")
    parser.add_argument("--raw", required=True, help="folder for the raw-write baseline")
    parser.add_argument("--repeat", type=int, default=2, help="saves per method (the best is reported)")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(backend="gloo")
    spec = JobSpec.model_validate_json(args.spec.read_text())
    plan = Plan.model_validate_json(args.plan.read_text())
    module, optimizer = build(plan, spec)
    gc.freeze()  # as the trainer does
    layout = state_layout(plan, spec.model)
    problems = layout_mismatches(layout, collect_state(module, optimizer, rank, torch.device("cpu")), rank)
    assert not problems, problems
    state = collect_state(module, optimizer, rank, torch.device("cpu"), local=True)  # what the trainer saves
    options = dict(spec.storage.storage_options)  # the raw and DCP baselines' too
    checkpoints = job_store(spec)
    store = checkpoints.store
    remote = not store.is_local
    if remote:
        count_s3_reads()
    out: dict[str, Any] = {"phase": args.phase, "ranks": world}

    if args.phase == "save":
        ck = Checkpointer(checkpoints, layout, rank, group, keep=args.repeat)
        ck.snapshot(state)
        views = [memoryview(t.reshape(-1).view(torch.uint8).numpy()) for t in ck.host_buffers]
        mine = sum(len(v) for v in views)
        raw_store = ObjectStore(args.raw, options) if remote else None
        if not remote:
            os.makedirs(args.raw, exist_ok=True)
        raw_s = min(timed(lambda: raw_write(f"{args.raw}/rank{rank}.bin", views, raw_store, f"rank{rank}.bin"), group)[0]
                    for _ in range(args.repeat))
        saves = []
        for step in range(1, args.repeat + 1):  # nothing else running: throughput, like the raw write
            seconds, _ = timed(lambda step=step: ck.save(step, state, {"samples_consumed": 0}, plan.model_dump(mode="json"),
                                                         {}, blocking=True), group)
            saves.append(seconds)
        ck.close()
        writer = (lambda: FsspecWriter(args.dcp, **options)) if remote else (lambda: FileSystemWriter(args.dcp))
        global_state = dcp_state(collect_state(module, optimizer, rank, torch.device("cpu")))  # DCP needs DTensors
        dcp_s = min(timed(lambda: dcp.save(global_state, storage_writer=writer(), process_group=group), group)[0]
                    for _ in range(args.repeat))
        written = total(mine, group)
        out.update(bytes_written=int(written), raw_write_s=raw_s, raw_write_MBps=written / raw_s / 1e6,
                   save_s=min(saves), save_MBps=written / min(saves) / 1e6, dcp_save_s=dcp_s)
    else:
        store.stats.reset()
        needed: list[int] = [0]

        def ours() -> None:
            restored = restore_latest(checkpoints, layout, rank, group,
                                      on_reads=lambda step, reads: needed.__setitem__(0, reads.bytes_needed),
                                      destinations=restore_destinations(optimizer, in_place=True))
            assert restored is not None, "nothing to restore"
            apply_state(restored.tensors, module, optimizer, rank, torch.device("cpu"), adopt=True)

        restore_s, _ = timed(ours, group)
        stats = store.stats.as_dict()
        ours_state = {k: local_data(v).clone() for k, v in dcp_state(collect_state(module, optimizer, rank, torch.device("cpu"))).items()}
        for p in module.parameters():  # scramble, so DCP's load must bring every value back
            local_data(p).data.fill_(0.5)
        target = dcp_state(collect_state(module, optimizer, rank, torch.device("cpu")))
        reader = FsspecReader(args.dcp, **options) if remote else FileSystemReader(args.dcp)
        before = read_bytes_of_process()
        dcp_s, _ = timed(lambda: dcp.load(target, storage_reader=reader, process_group=group), group)
        dcp_read = read_bytes_of_process() - before
        agree = all(torch.equal(local_data(target[k]), v) for k, v in ours_state.items())
        out.update(bytes_needed=int(total(needed[0], group)), bytes_read=int(total(stats["bytes_read"], group)),
                   requests=int(total(stats["get_requests"], group)), restore_s=restore_s, dcp_load_s=dcp_s,
                   dcp_bytes_read=int(total(dcp_read, group)), agree=bool(total(0 if agree else 1, group) == 0))
    if rank == 0:
        print("RESHARD " + json.dumps(out), flush=True)
    dist.barrier(group=group)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
