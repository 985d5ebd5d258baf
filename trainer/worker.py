"""The program torchrun starts on every device. Reads top to bottom: config -> distributed ->
data -> model -> parallelize -> restore -> loop. The global batch is fixed by the spec: each
data-parallel rank takes a contiguous share of every global batch (tensor-parallel peers take
the same share), and gradients are scaled so that their mean over the dp axis is the
global-batch mean on any device count.

Every plan takes one path: the ("pp", "dp", "tp") mesh (`trainer.mesh`), this rank's pipeline
stage (the whole model without "pp"), `trainer.parallel.parallelize` (DTensor tensor and
sequence parallelism, then FSDP2's replicate or fully_shard on dp), and with "pp" the
`trainer.pipeline` schedule (1F1B; PARASHIFT_PP_SCHEDULE=GPipe overrides it) over
plan.micro_batches micro-batches.

    torchrun --standalone --nproc-per-node N -m trainer.worker --spec spec.json --plan plan.json
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from parashift.corpus import DatasetError, TokenizerError
from parashift.models import family_of
from parashift.models.base import ModelFamily
from parashift.models.layers import token_loss_sum
from parashift.ptc import Slice
from parashift.ptc.reconfig import LIVE, LOCAL, RankReads
from parashift.specs import JobSpec
from parashift.specs.plan import Plan
from parashift.storage import JobPaths, StorageError, job_store
from parashift.trainer import metrics
from parashift.trainer.checkpoint import (
    Checkpointer,
    CheckpointsUnusable,
    Restored,
    SaveReport,
    node_tier,
    restore_latest,
    restore_totals,
)
from parashift.trainer.checkpoint import live as live_state
from parashift.trainer.checkpoint.group import broadcast
from parashift.trainer.control import StopRequests, may_leave
from parashift.trainer.data import (
    DataPosition,
    Prefetcher,
    SampleLog,
    SampleStream,
    micro_batches,
    rank_share,
    token_source,
)
from parashift.trainer.events import (
    CheckpointEvent,
    CheckpointStallEvent,
    FatalEvent,
    FinishedEvent,
    HeldEvent,
    RestoringEvent,
    StartEvent,
    StepEvent,
    StoppedEvent,
)
from parashift.trainer.layout import layout_mismatches, state_layout
from parashift.trainer.mesh import Coordinates, ParallelDims, job_plan_refusals
from parashift.trainer.optim import LocalShardAdamW
from parashift.trainer.parallel import (
    clip_grad_norm_,
    fsdp_mixed_precision,
    gradient_sync,
    initialize,
    local_grad_squares,
    loss_context,
    materialize,
    parallelize,
    plain,
    settle_gradients,
)
from parashift.trainer.pipeline import DEFAULT_SCHEDULE, PipelineRunner, build_stage
from parashift.trainer.scalars import Metrics
from parashift.trainer.schedule import learning_rate
from parashift.trainer.state import (
    OptimizerState,
    apply_state,
    collect_state,
    generator_states,
    held_by_first,
    rank_private,
    restore_destinations,
    rng_state_bytes,
)
from torch.distributed.constants import default_pg_timeout

log = logging.getLogger("parashift.worker")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spec", type=Path, required=True, help="the validated JobSpec as JSON")
    parser.add_argument("--plan", type=Path, required=True, help="the Plan as JSON")
    parser.add_argument("--until-step", type=int, default=None, help="checkpoint and stop at this step")
    return parser.parse_args(argv)


def init_distributed(kind: str) -> tuple[int, int, torch.device]:
    """Rank, world size and device from torchrun's environment (a single process without it),
    and the default process group: always one, so that every plan runs on a device mesh."""
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if kind == "cuda":
        # More ranks than GPUs (a check of multi-rank code on one GPU) share them round-robin.
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    # On GPUs the default group carries CPU collectives too (gloo) beside NCCL's CUDA ones.
    # PARASHIFT_DIST_BACKEND overrides it: NCCL refuses two ranks on one GPU, gloo does not.
    backend = os.environ.get("PARASHIFT_DIST_BACKEND") or ("cpu:gloo,cuda:nccl" if kind == "cuda" else "gloo")
    nccl = "nccl" in backend
    # A process started without torchrun has no rendezvous: it is a world of one, in memory. A
    # warm worker's job meets its peers under its own prefix of the pool's long-lived store.
    store = None if "MASTER_ADDR" in os.environ else dist.HashStore()
    prefix = os.environ.get("PARASHIFT_STORE_PREFIX")
    if store is None and prefix:
        store = dist.PrefixStore(prefix, dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                                       is_master=False, timeout=default_pg_timeout))
    dist.init_process_group(backend=backend, device_id=device if nccl else None, store=store,
                            rank=rank if store else -1, world_size=world_size if store else -1)
    return rank, world_size, device


def end_distributed(world_size: int) -> None:
    """Leave the process groups together. The caller drops what holds them first (FSDP2's
    replicate and fully_shard state, pipeline stages), while the groups are still registered: a gloo group destroyed
    from the reducer's destructor joins its I/O thread while holding the GIL that thread waits
    for (a hang at exit with torch 2.13), and one left to interpreter exit aborts the process
    ("terminate called without an active exception")."""
    gc.collect()
    if world_size > 1:
        dist.barrier()
    dist.destroy_process_group()


def is_warm_worker() -> bool:
    """Whether this process is a warm worker (`launcher.warm_pool`), booted before this job and
    serving others after it."""
    return os.environ.get("PARASHIFT_WARM_WORKER") == "1"


def seconds_since_process_start() -> float | None:
    """How long this process has existed (Linux /proc; None elsewhere): its interpreter start
    and imports, the largest part of a relaunch on a small machine."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return uptime - ticks / os.sysconf("SC_CLK_TCK")


class Phases:
    """Where a (re)launch's time goes, phase by phase, for the start event: the interpreter's
    start and imports first (the largest part on a small machine), then each phase of `main`."""

    def __init__(self) -> None:
        # A warm worker (launcher.warm_pool) booted long before this job: nothing of it is this launch's.
        self.seconds: dict[str, float | None] = {"boot_s": 0.0 if is_warm_worker() else seconds_since_process_start()}
        self._mark = time.perf_counter()

    def done(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = round(now - self._mark, 4)
        self._mark = now


@dataclass
class Batches:
    """This rank's data: the global sample stream every rank builds alike, and its share of
    each global batch (tensor-parallel peers take the same share)."""

    stream: SampleStream
    share_offset: int
    share_count: int
    micros: list[tuple[int, int]]  # (offset in the share, size) of each micro-batch

    def prefetcher(self, global_batch: int, pipelined: bool) -> Prefetcher:
        """A reader of this rank's batches, step after step: the whole share for a pipeline
        (which splits it itself), else each micro-batch."""
        requests = [(0, self.share_count)] if pipelined else self.micros
        return Prefetcher(self.stream, self.share_offset, requests, global_batch)


def rank_batches(spec: JobSpec, plan: Plan, dims: ParallelDims, coords: Coordinates) -> Batches:
    train = spec.training
    source = token_source(spec.data)
    ends = source.document_ends() if spec.data.samples == "documents" else None  # type: ignore[attr-defined]
    stream = SampleStream(source, spec.model.seq_len, train.seed, document_ends=ends)
    share_offset, share_count = rank_share(train.global_batch, dims.dp, coords.dp_rank)
    # The spec's micro-batch size, or smaller where the plan asks for more micro-batches
    # (gradient accumulation to cut activation memory; pipelines split the share themselves).
    micro_size = train.micro_batch if plan.micro_batches == 1 else min(train.micro_batch, -(-share_count // plan.micro_batches))
    return Batches(stream, share_offset, share_count, micro_batches(share_count, micro_size))


@dataclass
class Built:
    """This rank's part of the model under the Plan, allocated; its values come from the restore,
    or from `initial_part` where there is nothing to restore (`restore`)."""

    family: ModelFamily
    module: torch.nn.Module  # this rank's stage (the whole model without "pp"), parallelized
    runnable: torch.nn.Module  # what the forward pass calls (compiled, where the spec asks)
    optimizer: LocalShardAdamW
    n_params: int  # of the whole model
    regions: Any  # the plan's tensor-parallel regions
    initial_part: Callable[[str, tuple[int, ...], Slice], torch.Tensor]  # a box's initial values, the same under any plan


def build(spec: JobSpec, plan: Plan, dims: ParallelDims, coords: Coordinates, mesh: Any, device: torch.device,
          allocate_in: contextlib.AbstractContextManager[Any] | None = None) -> Built:
    """Built on the meta device (no memory), cut to this rank's stage, the Plan applied, then
    only this rank's parts allocated. Not filled: a job that resumes overwrites every value
    (the restore reads into the parameters in place), so drawing the initial weights first
    would cost every change of device count that CPU time (the weights of every rank's part
    drawn and copied, 0.1-0.2 s a rank here) for nothing. `restore` fills what it does not
    restore. `allocate_in`: a mode only the allocation and the optimizer run under
    (trainer.memory_probe's FakeTensorMode: the model must be built outside it)."""
    m = spec.model
    family = family_of(m)
    with torch.device("meta"):
        model = family.build(m)
    n_params = sum(p.numel() for p in model.parameters())
    n_layers = len(list(family.layers(model)))
    regions = plan.tp_regions(n_layers)
    module = build_stage(model, family, plan, n_layers, coords.pp_rank) if dims.pp > 1 else model
    runnable = parallelize(module, family, plan, mesh, regions, device, compile=spec.parallelism.compile,
                           precision=spec.parallelism.precision)

    def initial_part(name: str, shape: tuple[int, ...], box: Slice) -> torch.Tensor:
        return family.initial_part(m, name, shape, box, spec.training.seed)

    buffers = family.initial_buffers(m)  # real CPU values, outside `allocate_in`
    with allocate_in or contextlib.nullcontext():
        materialize(module, device, initial_part, buffers, fill=False)
        optimizer = LocalShardAdamW(module, spec, device)
    return Built(family, module, runnable, optimizer, n_params, regions, initial_part)


@dataclass
class Resumed:
    """Where training starts: step 0, or a restored checkpoint's step, data position and loss."""

    step: int = 0
    position: DataPosition = field(default_factory=DataPosition)
    loss: float | None = None
    restored: Restored | None = None
    reads: RankReads | None = None  # this rank's reads of the restore


def restore(spec: JobSpec, built: Built, layout: Any, checkpoints: Any, tier: Any, rank: int, group: Any,
            device: torch.device, live: live_state.LivePeers | None = None) -> Resumed:
    """This rank's boxes under this plan, from whatever plan saved the newest usable
    checkpoint; raises CheckpointsUnusable when none is and the spec does not start over.
    `live`: what warm workers hold from the segment before, taken from their memory.

    Parameters are read in place (not yet filled: nothing is lost if a checkpoint is refused
    half-way); where nothing is restored they get their initial values here, the same under
    any plan. Optimizer state goes into new tensors."""
    my_reads: list[RankReads] = []

    def restoring(at_step: int, reads: RankReads) -> None:
        my_reads[:] = [reads]
        if rank == 0:
            durable = None
            if live is not None and at_step == live.step:  # perhaps a pending step: which one is committed
                committed = checkpoints.manifest_steps()
                if at_step not in committed:
                    durable = max((s for s in committed if s < at_step), default=0)
            metrics.emit(RestoringEvent(step=at_step, bytes_needed=reads.bytes_needed, bytes_read=reads.bytes_read,
                                        requests=len(reads.requests), bytes_local=reads.bytes_from(LOCAL),
                                        bytes_live=reads.bytes_from(LIVE), durable_step=durable))

    destinations = restore_destinations(built.optimizer, in_place=True)
    # The optimizer's state (new tensors: a new job has none) is read into the old state's
    # memory where this process holds those boxes; parameters are read in place.
    fresh = [name for name in destinations if name.startswith(f"{OptimizerState.prefix}/")]
    destinations.update(live_state.held_boxes(spec.job_id, layout, rank, fresh))
    restored = restore_latest(checkpoints, layout, rank, group, tier, on_reads=restoring,
                              destinations=destinations,
                              start_over=spec.training.if_checkpoints_unusable == "start-over", live=live)
    if restored is None:  # step 0: the initial weights
        initialize(built.module, built.initial_part)
        if checkpoints.manifest_steps():  # every checkpoint refused: what a half-read one left goes too
            built.optimizer.clear_state()
        return Resumed()
    apply_state(restored.tensors, built.module, built.optimizer, rank, device, adopt=not spec.parallelism.compile)
    return Resumed(restored.step, DataPosition.from_manifest(restored.data_position),
                   restored.manifest.metadata.get("loss") if restored.manifest else None, restored,
                   my_reads[0] if my_reads else None)


def every_ranks_own(state: dict[str, torch.Tensor], world_size: int, group: Any) -> dict[str, torch.Tensor]:
    """Every rank's own state (its generator states: a few KB each), gathered on every rank
    (a collective): a warm worker that holds them all can serve a rank that died."""
    mine = {name: t.detach().cpu() for name, t in state.items() if rank_private(name) is not None}
    if world_size == 1:
        return mine
    everyone: list[Any] = [None] * world_size
    dist.all_gather_object(everyone, mine, group=group)  # in memory between this job's ranks; nothing from storage
    return {name: t for said in everyone for name, t in said.items()}


class PeersGenerators:
    """Every rank's generator states as of step `step`, kept by every warm rank: what a survivor
    of a peer's death needs to hold that step whole (the dead rank's generators included).
    Gathered at the start, and again after a step that moved any rank's generator (a flag in the
    step's report: no collective while none moves, as in a model without dropout)."""

    def __init__(self, rank: int, device: torch.device, world_size: int, step: int) -> None:
        self.rank, self.device, self.world_size = rank, device, world_size
        self.gather(step)

    def gather(self, step: int) -> None:
        """A collective on the default group (the loop's; the checkpoint's group is the saver's)."""
        self.step = step
        self.mine = generator_states(self.rank, self.device)
        self.every = every_ranks_own(self.mine, self.world_size, None)

    def moved(self) -> bool:
        """Whether this rank's generators moved since the last gather."""
        now = generator_states(self.rank, self.device)
        return any(not torch.equal(now[name], self.mine[name]) for name in now)


def _restored_url(store: Any, job_id: str, restored: Restored | None) -> str | None:
    """The manifest a segment started from: a committed one, or a pending one (live memory)."""
    if restored is None:
        return None
    paths = JobPaths(job_id)
    return store.url_for(paths.pending_manifest(restored.step) if restored.pending else paths.manifest(restored.step))


def where_ranks_run(node: str, world_size: int, group: Any) -> tuple[list[int], list[str]]:
    """Every rank's process id and node, by rank: which process is which rank in the run log
    when one fails, and whose node-local tier holds which rank's objects (in each manifest)."""
    where: list[tuple[int, str]] = [(os.getpid(), node)]
    if world_size > 1:
        where = [(0, "")] * world_size
        dist.all_gather_object(where, (os.getpid(), node), group=group)
    return [p for p, _ in where], [n for _, n in where]


class Saves:
    """The job's checkpoints from this rank: the state collected, checked once against its
    Layout, and handed to the asynchronous saver (the loop goes on while it is written)."""

    def __init__(self, spec: JobSpec, plan: Plan, built: Built, layout: Any, checkpointer: Checkpointer,
                 samples_per_epoch: int, rank: int, device: torch.device, metadata: dict[str, Any]) -> None:
        self.spec, self.plan, self.built, self.layout = spec, plan, built, layout
        self.checkpointer, self.samples_per_epoch = checkpointer, samples_per_epoch
        self.rank, self.device, self.metadata = rank, device, metadata
        self.checked = False

    def __call__(self, step: int, position: DataPosition, loss: float | None) -> None:
        module, optimizer = self.built.module, self.built.optimizer
        if not self.checked:  # once: the optimizer's state has the layout's boxes too
            problems = layout_mismatches(self.layout, collect_state(module, optimizer, self.rank, self.device), self.rank)
            if problems:
                raise SystemExit(f"rank {self.rank}: training state disagrees with its layout: " + "; ".join(problems[:5]))
            self.checked = True
        state = collect_state(module, optimizer, self.rank, self.device, local=True)
        self.checkpointer.save(step, state, *self.manifest_fields(position, loss))

    def manifest_fields(self, position: DataPosition, loss: float | None) -> tuple[dict[str, int], dict[str, Any], dict[str, Any]]:
        """A manifest's data position, plan and metadata for a step at `position` with `loss`:
        the same for a save, a pending manifest and a step a failure's survivors hold."""
        return position.to_manifest(self.samples_per_epoch), self.plan.model_dump(mode="json"), {**self.metadata, "loss": loss}

    def pending(self, step: int, position: DataPosition, loss: float | None) -> bool:
        """A planned change on warm workers: the step described by a pending manifest instead of
        saved (the next segment restores it from memory and saves it). False, on every rank,
        where that failed: the caller saves it."""
        state = collect_state(self.built.module, self.built.optimizer, self.rank, self.device, local=True)
        try:
            self.checkpointer.write_pending(step, state, *self.manifest_fields(position, loss))
        except StorageError as error:
            log.warning("rank %d: %s; saving step %d instead", self.rank, error, step)
            return False
        return True


@dataclass
class Ended:
    """Where the training loop ended (or, while it runs, stands): the step, the data position,
    whether it was asked to stop, and whether that step still has to be saved (a planned change
    on warm workers: `Saves.pending`). `consistent`: the model and optimizer are that step's
    (False while the optimizer changes them)."""

    step: int
    position: DataPosition
    stopped: bool = False
    unsaved: bool = False
    loss: float | None = None
    consistent: bool = True


def hold_after_failure(spec: JobSpec, built: Built, layout: Any, save: Saves, where: Ended,
                       generators: PeersGenerators) -> None:
    """A warm worker whose peer died: keep the state of the last step it completed for the job's
    next segment (`trainer.checkpoint.live`), and say so where it holds that step whole."""
    rank, device = generators.rank, generators.device
    state = {**collect_state(built.module, built.optimizer, rank, device, local=True), **generators.mine}
    facts = live_state.Unrecorded(layout, *save.manifest_fields(where.position, where.loss))
    held = live_state.hold(spec.job_id, where.step, layout, rank, state, others=generators.every, unrecorded=facts)
    if held.whole():
        metrics.emit(HeldEvent(step=where.step, samples_consumed=where.position.samples_consumed))


def holds_for_next(stops: StopRequests, layout: Any, rank: int, world_size: int, device: torch.device) -> bool:
    """At a stop: whether the ranks keep the step in memory for the next segment instead of
    saving it first, decided by rank 0 for all. Only warm workers, only for a planned change
    (the stop object names the next device count), and only where the ranks the next segment
    keeps (the first ones) hold every box it can need."""
    devices = stops.next_devices() if rank == 0 and is_warm_worker() else None
    decision = torch.tensor([1.0 if devices is not None and held_by_first(layout, devices) else 0.0], device=device)
    if world_size > 1:
        dist.broadcast(decision, src=0)
    return decision.item() > 0


def train(spec: JobSpec, plan: Plan, built: Built, batches: Batches, dims: ParallelDims, coords: Coordinates,
          mesh: Any, device: torch.device, world_size: int, rank: int, resumed: Resumed, end_step: int,
          checkpointer: Checkpointer, save: Saves, stops: StopRequests, layout: Any = None,
          where: Ended | None = None, generators: PeersGenerators | None = None,
          board: Metrics | None = None) -> Ended:
    """The training loop from `resumed` to `end_step` or a stop. `where` follows it step by step
    (what a warm worker holds when a peer dies mid-step); `generators`, every rank's generator
    states with it; `board`, rank 0's metrics component (trainer.scalars)."""
    train_spec, m = spec.training, spec.model
    module, runnable, optimizer, family = built.module, built.runnable, built.optimizer, built.family
    reader = batches.prefetcher(train_spec.global_batch, pipelined=dims.pp > 1)
    step, position, loss = resumed.step, resumed.position, resumed.loss
    tokens_per_step = train_spec.global_batch * m.seq_len
    autocast = (  # bf16 by autocast, unless FSDP2's policy already computes in bf16
        torch.autocast(device.type, dtype=torch.bfloat16)
        if spec.parallelism.precision == "bf16" and not fsdp_mixed_precision(plan, spec.parallelism.precision)
        else contextlib.nullcontext()
    )
    # Each dp rank's gradient is scaled by dp / global tokens: the mean over the dp axis then
    # yields the mean over every token of the global batch, whatever the share sizes.
    loss_scale = dims.dp / tokens_per_step
    pipeline = None
    if dims.pp > 1:
        pipeline = PipelineRunner(runnable, mesh["pp"], device, plan.micro_batches, token_loss_sum, loss_scale,
                                  os.environ.get("PARASHIFT_PP_SCHEDULE", DEFAULT_SCHEDULE))
    # The loss is counted once per dp rank: on the last stage, by tp rank 0.
    counts_loss = coords.tp_rank == 0 and coords.pp_rank == dims.pp - 1
    stopped = False
    where = where if where is not None else Ended(step, position, loss=loss)
    sample_log = SampleLog.from_env(rank)
    reader.start(position.samples_consumed)
    try:
        while step < end_step:
            started = time.perf_counter()
            may_leave(generators is not None)  # a warm rank may leave this step when a peer dies (trainer.control)
            lr = learning_rate(step, train_spec.steps, spec.optimizer)
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss_sum = torch.zeros((), device=device)
            waited = reader.wait_s
            step_batches = reader.step(position.samples_consumed)
            waited = reader.wait_s - waited
            if sample_log is not None:
                first = position.samples_consumed + batches.share_offset
                sample_log.write(step + 1, coords.dp_rank, batches.stream.sample_ids(first, batches.share_count),
                                 world_size, resumed.step)
            if pipeline is not None:
                inputs, targets = step_batches[0]  # (share, T) each
                with autocast:
                    loss_sum += pipeline.step(inputs.to(device), targets.to(device))
            for i, (inputs, targets) in enumerate(step_batches if pipeline is None else []):
                inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
                last = i == len(step_batches) - 1
                with gradient_sync(runnable, last), loss_context(built.regions):
                    with autocast:
                        micro_loss = token_loss_sum(family.logits(runnable, inputs), targets)  # scalar, sum over tokens
                    (micro_loss * loss_scale).backward()
                loss_sum += plain(micro_loss.detach()).float()
            settle_gradients(list(module.parameters()))
            # The norm clips (its own collective), or is only logged: then each rank's part of it
            # rides on the step's report below, and no collective is added.
            logged = (step + 1) % train_spec.log_every == 0 or step + 1 in (end_step, resumed.step + 1)
            grad_norm, squares = None, torch.zeros((), device=device)
            if spec.optimizer.grad_clip:
                grad_norm = clip_grad_norm_(list(module.parameters()), spec.optimizer.grad_clip, coords.within_stage())
            elif logged:
                squares = local_grad_squares(list(module.parameters()), coords.within_stage())
            checkpointer.before_update()  # a save in flight may still be reading these tensors
            may_leave(False)
            where.consistent = False  # no collective until the step count follows the update
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            position = DataPosition(position.samples_consumed + train_spec.global_batch)
            where.step, where.position, where.loss, where.consistent = step, position, None, True
            if checkpointer.last_stall_s is not None:  # how long the newest save held the loop, slowest rank
                stall = torch.tensor([checkpointer.last_stall_s], dtype=torch.float64, device=device)
                if world_size > 1:
                    dist.all_reduce(stall, op=dist.ReduceOp.MAX)
                if rank == 0:
                    metrics.emit(CheckpointStallEvent(step=step, stall_s=round(stall.item(), 4)))
                checkpointer.last_stall_s = None

            # one small all-reduce: the global loss, whether any rank was asked to stop, and
            # whether any rank's generators moved (then every rank's are gathered again)
            report = torch.stack([loss_sum if counts_loss else torch.zeros_like(loss_sum),
                                  torch.tensor(float(stops.requested()), device=device),
                                  torch.tensor(float(generators is not None and generators.moved()), device=device),
                                  squares.to(loss_sum.dtype)])
            if world_size > 1:
                dist.all_reduce(report)
            loss, stop_now = report[0].item() / tokens_per_step, report[1].item() > 0
            if grad_norm is None and logged:
                grad_norm = report[3].sqrt()
            where.loss = loss
            if generators is not None:
                if report[2].item() > 0:
                    generators.gather(step)
                else:  # nobody's moved: what was gathered is this step's too
                    generators.step = step
            elapsed = time.perf_counter() - started
            # Every log_every steps, and the first and last of a segment (a change's downtime ends and starts there).
            if rank == 0 and (step % train_spec.log_every == 0 or step in (end_step, resumed.step + 1) or stop_now):
                norm = float(grad_norm) if grad_norm is not None else None
                numbers = board.numbers(tokens_per_step / elapsed) if board is not None else {}
                event = StepEvent(step=step, loss=loss, lr=lr, step_s=elapsed, tokens_per_s=tokens_per_step / elapsed,
                                  data_wait_s=round(waited, 6), data_tokens_per_s=reader.tokens_per_s,
                                  grad_norm=norm, **numbers)
                metrics.emit(event)
                if board is not None:
                    board.record(step, {"loss": loss, "grad_norm": norm, "lr": lr, "tokens_per_s": event.tokens_per_s,
                                        "tflops": event.tflops, "mfu": event.mfu, "memory_gib": event.memory_gib,
                                        "data_wait_s": event.data_wait_s})
            # Restored from live ranks' memory by a pending manifest (nothing stores that step):
            # the first step done is saved, whatever the schedule, in the background as any save.
            regular = (step % train_spec.checkpoint_every == 0 or step == end_step
                       or (step == resumed.step + 1 and resumed.restored is not None and resumed.restored.pending))
            if stop_now and not regular and layout is not None and holds_for_next(stops, layout, rank, world_size, device):
                return Ended(step, position, stopped=True, unsaved=True, loss=loss)
            if regular or stop_now:
                save(step, position, loss)
            if stop_now and step < end_step:
                stopped = True
                break
    finally:
        may_leave(False)
        reader.close()
    return Ended(step, position, stopped, loss=loss)


def main(argv: list[str] | None = None) -> int:
    phases = Phases()
    args = parse_args(argv)
    # The rank in every record: the run log interleaves every worker's lines.
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s rank{os.environ.get('RANK', '0')} %(name)s: %(message)s")
    spec = JobSpec.model_validate_json(args.spec.read_text())
    plan = Plan.model_validate_json(args.plan.read_text())
    train_spec = spec.training
    refusals = job_plan_refusals(plan, spec)
    if refusals:
        raise SystemExit(f"cannot execute plan with mesh {plan.mesh}: " + "; ".join(refusals))
    dims = ParallelDims.from_plan(plan)
    end_step = min(train_spec.steps, args.until_step or train_spec.steps)

    rank, world_size, device = init_distributed(spec.resources.kind)
    if world_size != plan.devices:
        raise SystemExit(f"plan is for {plan.devices} devices, torchrun started {world_size}")
    mesh = dims.build_mesh(device.type)
    coords = Coordinates.of(mesh, dims)
    phases.done("distributed_s")

    try:
        batches = rank_batches(spec, plan, dims, coords)
    except (DatasetError, TokenizerError) as error:  # every rank reads the same: rank 0 says it once
        if rank == 0:
            metrics.emit(FatalEvent(message=f"data: {error}"))
        end_distributed(world_size)
        return metrics.EXIT_FATAL
    phases.done("data_s")

    built = build(spec, plan, dims, coords, mesh, device)
    warm = is_warm_worker()
    # Everything built so far lives for the whole run: keep it out of the garbage collector's
    # full passes, which otherwise cost ~0.3 s whenever a restore or a save allocates many small
    # objects (seen parsing a manifest: 5 ms alone, 0.3 s in a worker). A warm worker froze its
    # imports at boot, and must not freeze this job's objects: the next job needs them collected.
    if not warm:
        gc.freeze()
    # Dropout's stream: one per data-parallel share and pipeline stage, the same on tp peers
    # (trainer.parallel.apply_dropout_streams gives sharded activations streams of their own).
    torch.manual_seed(train_spec.seed + 1 + coords.pp_rank * dims.dp + coords.dp_rank)
    phases.done("build_s")

    layout = state_layout(plan, spec.model, rng_state_bytes(device))
    mismatches = layout_mismatches(layout, {f"model/{n}": p for n, p in built.module.named_parameters()}, rank)
    if mismatches:
        raise SystemExit(f"rank {rank}: the plan's layout disagrees with the parallelized model: " + "; ".join(mismatches[:5]))
    # Checkpoint coordination gets its own gloo group: saves talk from a background thread
    # while training uses the default group, and CPU collectives work there on any device.
    ckpt_group = dist.new_group(backend="gloo") if world_size > 1 else None  # None: nobody to talk to
    checkpoints = job_store(spec)
    node = os.environ.get("PARASHIFT_NODE", "local")  # set by a launcher of a job across nodes
    tier = node_tier(spec.storage.local_tier, node)
    # A warm worker may hold the job's newest committed state from the segment before: what
    # every rank holds is said once, and the restore takes those boxes from memory.
    if live_state.held(spec.job_id) is None:
        live_state.release()  # another job's state: not this one's to serve
    live = live_state.LivePeers.gather(spec.job_id, rank, ckpt_group) if warm else None
    if live is not None and live.recorders:  # a failure's survivors hold a step nothing describes yet
        newest = broadcast(max(checkpoints.manifest_steps(), default=-1) if rank == 0 else None, ckpt_group)
        live.record(checkpoints, rank, newest)
    phases.done("layout_s")
    try:
        resumed, unusable = restore(spec, built, layout, checkpoints, tier, rank, ckpt_group, device, live), None
    except CheckpointsUnusable as error:
        unusable = str(error)  # outside the handler: its traceback's frames hold the model
    live = None
    live_state.release()  # restored (or refused): the old state's memory goes back
    if unusable is not None:  # no retry can fix it: said once, and the run ends
        if rank == 0:
            metrics.emit(FatalEvent(message=unusable))
        built = ckpt_group = None  # holders of process groups first (see end_distributed)
        end_distributed(world_size)
        return metrics.EXIT_FATAL
    phases.done("restore_s")

    store = checkpoints.store
    stops = StopRequests(store, spec.job_id, poll=rank == 0)
    pids, nodes = where_ranks_run(node, world_size, ckpt_group)
    restore_bytes = restore_totals(resumed.reads if resumed.restored is not None else None, ckpt_group)
    if rank == 0:
        metrics.emit(StartEvent(
            pids=pids,
            nodes=nodes,
            restore_bytes=restore_bytes,
            restore_s=phases.seconds["restore_s"],
            phases=phases.seconds,
            step=resumed.step,
            resumed=resumed.restored is not None,
            checkpoint_loss=resumed.loss,
            checkpoint_url=_restored_url(store, spec.job_id, resumed.restored),
            world_size=world_size,
            params=built.n_params,
            flops_per_token=built.family.flops_per_token(spec.model, built.n_params),
            end_step=end_step,
        ))

    def committed(report: SaveReport) -> None:
        metrics.emit(CheckpointEvent(step=report.step, url=report.url, stall_s=round(report.stall_s, 4),
                                     write_s=round(report.write_s, 4), bytes_written=report.bytes_written))

    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    checkpointer = Checkpointer(checkpoints, layout, rank, ckpt_group, train_spec.keep_checkpoints,
                                on_commit=committed if rank == 0 else None, tier=tier,
                                tier_budget_bytes=int(spec.storage.local_tier_max_gb * 1e9 / ranks_here),
                                resumed_from=resumed.restored.manifest if resumed.restored is not None else None,
                                resumed_pending=resumed.restored is not None and resumed.restored.pending)
    # Where the spec came from (repository, commit, path), when a flow says so: kept in each manifest.
    source = {"source": json.loads(os.environ["PARASHIFT_SOURCE"])} if os.environ.get("PARASHIFT_SOURCE") else {}
    save = Saves(spec, plan, built, layout, checkpointer, batches.stream.samples_per_epoch, rank, device,
                 {"model": spec.model.model_dump(), "job": spec.name, "nodes": nodes, **source})
    where = Ended(resumed.step, resumed.position, loss=resumed.loss)
    generators = PeersGenerators(rank, device, world_size, resumed.step) if warm and world_size > 1 else None
    board = None
    if rank == 0:
        board = Metrics(store, spec.job_id, built.family.flops_per_token(spec.model, built.n_params), world_size, device,
                        spec.parallelism.precision, plan.device_peak_flops, spec.metrics.tensorboard, resumed.step)
    try:
        ended = train(spec, plan, built, batches, dims, coords, mesh, device, world_size, rank,
                      resumed, end_step, checkpointer, save, stops, layout if warm else None, where, generators, board)
    except DatasetError as error:  # a damaged shard, found as this rank read it: no retry can fix it
        metrics.emit(FatalEvent(message=f"data: {error}"))
        os._exit(metrics.EXIT_FATAL)  # the other ranks wait in a collective; torchrun ends them
    except BaseException:
        # A peer died, say. The save in flight must change nothing after this: a warm worker
        # goes on to serve the job's recovery, which may write the same step again.
        checkpointer.abandon()
        if generators is not None and where.consistent and generators.step == where.step:
            try:
                hold_after_failure(spec, built, layout, save, where, generators)
            except Exception as error:  # noqa: BLE001 - the job resumes from its last commit instead
                log.warning("rank %d: step %d not held after the failure (%s)", rank, where.step, error)
        raise
    finally:
        if board is not None:
            board.close()
    step, position, stopped = ended.step, ended.position, ended.stopped
    if ended.unsaved and not save.pending(step, position, ended.loss):
        save(step, position, ended.loss)
        ended.unsaved = False

    checkpointer.close()  # the last save is committed before anyone reports or exits
    if warm:  # the committed (or pending) state stays in this process for the job's next segment
        state = collect_state(built.module, built.optimizer, rank, device, local=True)
        live_state.hold(spec.job_id, step, layout, rank, state, others=every_ranks_own(state, world_size, ckpt_group))
    if rank == 0:
        if stopped:
            metrics.emit(StoppedEvent(step=step, samples_consumed=position.samples_consumed, pending=ended.unsaved))
        else:
            metrics.emit(FinishedEvent(step=step, samples_consumed=position.samples_consumed))
    built = save = resumed = ckpt_group = None  # holders of process groups first (see end_distributed)
    end_distributed(world_size)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
