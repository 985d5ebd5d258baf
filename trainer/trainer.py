"""One rank's segment of a job, in steps: `setup` (process groups, data, the model under the
Plan), `restore` (the newest usable state), `start` (the saver, the stop requests, the start
event), `train` (`train_step` after `train_step`, saving on schedule, until the end or a stop)
and `finish` (the last save committed, the final event). A warm worker's part comes in through
explicit hooks (`trainer.warm.WarmHooks`); a torchrun worker has none.

The global batch is fixed by the spec: each data-parallel rank takes a contiguous share of every
global batch (tensor-parallel peers take the same share), and gradients are scaled so that their
mean over the dp axis is the global-batch mean on any device count.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import time
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from parashift.corpus import DatasetError, TokenizerError
from parashift.models.hub import CheckpointUnreadable
from parashift.models.layers import token_loss_sum
from parashift.specs import JobSpec, environ
from parashift.specs.plan import Plan
from parashift.storage import job_store
from parashift.trainer import metrics
from parashift.trainer.build import build as build_model
from parashift.trainer.build import rank_batches
from parashift.trainer.checkpoint import (
    Checkpointer,
    CheckpointsUnusable,
    SaveReport,
    node_tier,
    restore_totals,
)
from parashift.trainer.checkpoint import live as live_state
from parashift.trainer.checkpoint.saver import failed_write
from parashift.trainer.control import StopRequests, may_leave
from parashift.trainer.data import DataPosition, SampleLog
from parashift.trainer.distributed import end_distributed, init_distributed, where_ranks_run
from parashift.trainer.evaluate import evaluate, held_out
from parashift.trainer.events import (
    CheckpointEvent,
    CheckpointStallEvent,
    FatalEvent,
    FinishedEvent,
    StartEvent,
    StepEvent,
    StoppedEvent,
    step_scalars,
)
from parashift.trainer.layout import layout_mismatches, state_layout
from parashift.trainer.mesh import Coordinates, ParallelDims
from parashift.trainer.parallel import (
    clip_grad_norm_,
    fsdp_mixed_precision,
    gradient_sync,
    local_grad_squares,
    loss_context,
    plain,
    settle_gradients,
)
from parashift.trainer.pipeline import PipelineRunner
from parashift.trainer.resume import restore, restored_url
from parashift.trainer.saves import Ended, Saves
from parashift.trainer.scalars import Metrics
from parashift.trainer.schedule import learning_rate
from parashift.trainer.state import rng_state_bytes
from parashift.trainer.warm import Gathered, WarmHooks, is_warm_worker


class Fatal(Exception):
    """No retry can fix it (unreadable data, unusable checkpoints): said once, the run ends."""


@dataclass
class StepDone:
    """What one training step reports: its loss over the global batch, gradient norm (where
    logged), whether any rank was asked to stop, and its timings."""

    loss: float
    grad_norm: float | None
    stop_now: bool
    lr: float
    elapsed_s: float
    data_wait_s: float


class Trainer:
    """One rank of one segment. `phases` times each step of the setup (`Phases.done`)."""

    def __init__(self, spec: JobSpec, plan: Plan, until_step: int | None, phases: Any) -> None:
        self.spec, self.plan, self.phases = spec, plan, phases
        self.dims = ParallelDims.from_plan(plan)
        self.end_step = min(spec.training.steps, until_step or spec.training.steps)
        self.warm: WarmHooks | None = None
        self.built: Any = None
        self.ckpt_group: Any = None

    # -- setup ------------------------------------------------------------------------------

    def setup(self) -> None:
        """Process groups and mesh, this rank's data, its part of the model and its layout."""
        spec, plan = self.spec, self.plan
        self.rank, self.world_size, self.device = init_distributed(spec.resources.kind, spec.resources.backend)
        if self.world_size != plan.devices:
            raise SystemExit(f"plan is for {plan.devices} devices, torchrun started {self.world_size}")
        self.mesh = self.dims.build_mesh(self.device.type)
        self.coords = Coordinates.of(self.mesh, self.dims)
        self.phases.done("distributed_s")
        try:
            self.batches = rank_batches(spec, plan, self.dims, self.coords)
            self.held_out = held_out(spec, self.dims, self.coords, self.batches.share_count)
        except (DatasetError, TokenizerError, ValueError) as error:  # every rank reads the same: rank 0 says it once
            raise Fatal(f"data: {error}") from None
        self.phases.done("data_s")
        self.built = build_model(spec, plan, self.dims, self.coords, self.mesh, self.device)
        if is_warm_worker():
            self.warm = WarmHooks(spec, self.rank, self.world_size, self.device)
        else:
            # Everything built so far lives for the whole run: keep it out of the garbage
            # collector's full passes, which otherwise cost ~0.3 s whenever a restore or a save
            # allocates many small objects. A warm worker froze its imports at boot, and must not
            # freeze this job's objects: the next job needs them collected.
            gc.freeze()
        # Dropout's stream: one per data-parallel share and pipeline stage, the same on tp peers
        # (trainer.parallel.apply_dropout_streams gives sharded activations streams of their own).
        torch.manual_seed(spec.training.seed + 1 + self.coords.pp_rank * self.dims.dp + self.coords.dp_rank)
        self.phases.done("build_s")
        self.layout = state_layout(plan, spec.model, rng_state_bytes(self.device))
        params = {f"model/{n}": p for n, p in self.built.module.named_parameters()}
        mismatches = layout_mismatches(self.layout, params, self.rank)
        if mismatches:
            raise SystemExit(f"rank {self.rank}: the plan's layout disagrees with the parallelized model: "
                             + "; ".join(mismatches[:5]))

    # -- restore ----------------------------------------------------------------------------

    def restore(self) -> None:
        """The newest usable state for this rank's boxes (storage, the node's tier, or warm
        peers' memory), else the initial weights."""
        spec = self.spec
        # Checkpoint coordination gets its own gloo group: saves talk from a background thread
        # while training uses the default group, and CPU collectives work there on any device.
        self.ckpt_group = dist.new_group(backend="gloo") if self.world_size > 1 else None  # None: nobody to talk to
        self.checkpoints = job_store(spec)
        self.node = os.environ.get(environ.NODE, "local")  # set by a launcher of a job across nodes
        self.tier = node_tier(spec.storage.local_tier, self.node)
        if live_state.held(spec.job_id) is None:
            live_state.release()  # another job's state: not this one's to serve
        live = self.warm.peers(self.checkpoints, self.ckpt_group) if self.warm is not None else None
        self.phases.done("layout_s")
        try:
            self.resumed, unusable = restore(spec, self.built, self.layout, self.checkpoints, self.tier, self.rank,
                                             self.ckpt_group, self.device, live), None
        except CheckpointsUnusable as error:
            unusable = str(error)  # outside the handler: its traceback's frames hold the model
        except CheckpointUnreadable as error:  # the initial weights' folder: every retry would read it again
            unusable = f"model.init_from: {error}"
        live = None
        live_state.release()  # restored (or refused): the old state's memory goes back
        if unusable is not None:
            raise Fatal(unusable)
        self.phases.done("restore_s")

    # -- start ------------------------------------------------------------------------------

    def start(self) -> None:
        """The stop requests, the saver, the metrics board; rank 0 reports the start."""
        spec, plan, rank, resumed = self.spec, self.plan, self.rank, self.resumed
        store = self.checkpoints.store
        self.stops = StopRequests(store, spec.job_id, spec.training.stop_poll_s, poll=rank == 0)
        pids, nodes = where_ranks_run(self.node, self.world_size, self.ckpt_group)
        restore_bytes = restore_totals(resumed.reads if resumed.restored is not None else None, self.ckpt_group)
        flops_per_token = self.built.family.flops_per_token(spec.model, self.built.n_params)
        if rank == 0:
            metrics.emit(StartEvent(
                pids=pids, nodes=nodes, restore_bytes=restore_bytes, restore_s=self.phases.seconds["restore_s"],
                phases=self.phases.seconds, step=resumed.step, resumed=resumed.restored is not None,
                checkpoint_loss=resumed.loss, checkpoint_url=restored_url(store, spec.job_id, resumed.restored),
                world_size=self.world_size, params=self.built.n_params, flops_per_token=flops_per_token,
                end_step=self.end_step,
            ))

        def committed(report: SaveReport) -> None:
            if self.board is not None:  # the steps up to a commit are never trained again: their scalars are copied now
                self.board.flush()
            metrics.emit(CheckpointEvent(step=report.step, url=report.url, stall_s=round(report.stall_s, 4),
                                         write_s=round(report.write_s, 4), bytes_written=report.bytes_written,
                                         bytes_total=report.bytes_total, ranks=report.ranks))

        ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        restored = resumed.restored
        self.checkpointer = Checkpointer(
            self.checkpoints, self.layout, rank, self.ckpt_group, spec.training.keep_checkpoints,
            on_commit=committed if rank == 0 else None, tier=self.tier,
            tier_budget_bytes=int(spec.storage.local_tier_max_gb * 1e9 / ranks_here),
            resumed_from=restored.manifest if restored is not None else None,
            resumed_pending=restored is not None and restored.pending)
        # Where the spec came from (repository, commit, path), when a flow says so: kept in each manifest.
        source = {"source": json.loads(os.environ[environ.SOURCE])} if os.environ.get(environ.SOURCE) else {}
        self.save = Saves(spec, plan, self.built, self.layout, self.checkpointer,
                          self.batches.stream.samples_per_epoch, rank, self.device,
                          {"model": spec.model.model_dump(), "job": spec.name, "nodes": nodes, **source})
        self.where = Ended(resumed.step, resumed.position, loss=resumed.loss)
        if self.warm is not None:
            self.warm.follow(resumed.step)
        self.board = None
        if rank == 0:
            self.board = Metrics(store, spec.job_id, flops_per_token, self.world_size, self.device,
                                 spec.parallelism.precision, plan.device_peak_flops, spec.metrics.tensorboard,
                                 resumed.step, spec.metrics.wandb_project if spec.metrics.wandb else None)

    # -- train ------------------------------------------------------------------------------

    def train(self) -> Ended:
        """`train_step` from the resumed step to the end or a stop, saving on schedule. A warm
        worker whose peer dies holds the last step it completed (`WarmHooks.after_failure`)."""
        try:
            return self._loop()
        except DatasetError as error:  # a damaged shard, found as this rank read it: no retry can fix it
            self._end_fatally(f"data: {error}")
        except BaseException as error:
            # A peer died, say. The save in flight must change nothing after this: a warm worker
            # goes on to serve the job's recovery, which may write the same step again.
            self.checkpointer.abandon()
            full = failed_write(error)
            if full is not None and full.no_space:  # every retry would write into the same full disk
                committed = max(self.checkpoints.manifest_steps(), default=None)
                self._end_fatally(f"no space left on device writing checkpoint {full.step} to "
                                  f"{self.spec.storage.url}; the last committed step is "
                                  f"{committed if committed is not None else 'none'}")
            if self.warm is not None:
                self.warm.after_failure(self.built, self.layout, self.save, self.where)
            raise
        finally:
            if self.board is not None:
                self.board.close()

    def _end_fatally(self, message: str) -> NoReturn:
        """An error no retry can fix, met mid-step: said, and this rank ends at once (the other
        ranks may wait in a collective; their launcher ends them). A warm worker's process
        serves on: only its job ends, with the fatal exit code."""
        metrics.emit(FatalEvent(message=message))
        if self.warm is not None:
            raise SystemExit(metrics.EXIT_FATAL) from None
        os._exit(metrics.EXIT_FATAL)

    def _loop(self) -> Ended:
        spec, train_spec, dims, device = self.spec, self.spec.training, self.dims, self.device
        resumed = self.resumed
        self.reader = self.batches.prefetcher(train_spec.global_batch, pipelined=dims.pp > 1)
        self.autocast = (  # bf16 by autocast, unless FSDP2's policy already computes in bf16
            torch.autocast(device.type, dtype=torch.bfloat16)
            if spec.parallelism.precision == "bf16" and not fsdp_mixed_precision(self.plan, spec.parallelism.precision)
            else contextlib.nullcontext())
        self.tokens_per_step = train_spec.global_batch * spec.model.seq_len
        self.pipeline = None
        if dims.pp > 1:
            self.pipeline = PipelineRunner(self.built.runnable, self.mesh["pp"], device, self.plan.micro_batches,
                                           token_loss_sum, self.loss_scale, spec.parallelism.pp_schedule)
        self.sample_log = SampleLog.from_env(self.rank, self.spec.job_id)
        step, position, loss = resumed.step, resumed.position, resumed.loss
        self.reader.start(position.samples_consumed)
        try:
            while step < self.end_step:
                done = self.train_step(step, position)
                step, position, loss = step + 1, DataPosition(position.samples_consumed + train_spec.global_batch), done.loss
                self._log_step(step, done, self._evaluate_after(step))
                # On the spec's schedule only, also after a restore from live ranks' memory (a pending
                # manifest): the newest durable step then is the commit before the change, as far
                # behind as it would be with no change at all. An extra save per change was an extra
                # checkpoint write for every resize of a pool (measured: ~0.1 s of the next step here).
                regular = step % train_spec.checkpoint_every == 0 or step == self.end_step
                if done.stop_now and not regular and self.warm is not None and self.warm.holds_for_next(
                        self.stops, self.layout):
                    return Ended(step, position, stopped=True, unsaved=True, loss=loss)
                if regular or done.stop_now:
                    self.save(step, position, loss)
                if done.stop_now and step < self.end_step:
                    return Ended(step, position, True, loss=loss)
        finally:
            may_leave(False)
            self.reader.close()
        return Ended(step, position, False, loss=loss)

    @property
    def loss_scale(self) -> float:
        """Each dp rank's gradient is scaled by dp / global tokens: the mean over the dp axis is
        then the mean over every token of the global batch, whatever the share sizes."""
        return self.dims.dp / (self.spec.training.global_batch * self.spec.model.seq_len)

    def train_step(self, step: int, position: DataPosition) -> StepDone:
        """Step `step` + 1: forward and backward of this rank's share, the gradients settled and
        clipped, the optimizer's update, and one small all-reduce for the step's report."""
        spec, device, built, where = self.spec, self.device, self.built, self.where
        started = time.perf_counter()
        may_leave(self.warm is not None and self.warm.follows)  # a warm rank may leave when a peer dies
        lr = learning_rate(step, spec.training.steps, spec.optimizer)
        for group in built.optimizer.param_groups:
            group["lr"] = lr
        waited = self.reader.wait_s
        step_batches = self.reader.step(position.samples_consumed)
        waited = self.reader.wait_s - waited
        if self.sample_log is not None:
            first = position.samples_consumed + self.batches.share_offset
            self.sample_log.write(step + 1, self.coords.dp_rank,
                                  self.batches.stream.sample_ids(first, self.batches.share_count),
                                  self.world_size, self.resumed.step)
        loss_sum = self._forward_backward(step_batches)
        params = list(built.module.parameters())
        settle_gradients(params)
        # The norm clips (its own collective), or is only logged: then each rank's part of it
        # rides on the step's report below, and no collective is added.
        logged = (step + 1) % spec.training.log_every == 0 or step + 1 in (self.end_step, self.resumed.step + 1)
        grad_norm, squares = None, torch.zeros((), device=device)
        if spec.optimizer.grad_clip:
            grad_norm = clip_grad_norm_(params, spec.optimizer.grad_clip, self.coords.within_stage())
        elif logged:
            squares = local_grad_squares(params, self.coords.within_stage())
        self.checkpointer.before_update()  # a save in flight may still be reading these tensors
        # Every collective of the step before its update: a rank that dies at any moment leaves
        # its peers with a whole step, this one's or the last (a warm worker holds it), never an
        # update ahead of what they gathered of each other's generators.
        self._report_stall(step + 1)
        loss, stop_now, norm, gathered = self._report(step + 1, loss_sum, squares)
        may_leave(False)
        where.consistent = False  # no collective until the step count follows the update
        built.optimizer.step()
        built.optimizer.zero_grad()
        where.step, where.position, where.loss, where.consistent = (
            step + 1, DataPosition(position.samples_consumed + spec.training.global_batch), None, True)
        if self.warm is not None:
            self.warm.stepped(step + 1, gathered)
        if grad_norm is None and logged:
            grad_norm = norm
        where.loss = loss
        return StepDone(loss, float(grad_norm) if grad_norm is not None else None, stop_now, lr,
                        time.perf_counter() - started, waited)

    def _forward_backward(self, step_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """This rank's share through the model: the pipeline's schedule, or each micro-batch in
        turn (gradients synchronised on the last). Returns the summed token loss."""
        device, built = self.device, self.built
        loss_sum = torch.zeros((), device=device)
        if self.pipeline is not None:
            inputs, targets = step_batches[0]  # (share, T) each
            with self.autocast:
                loss_sum += self.pipeline.step(inputs.to(device), targets.to(device))
            return loss_sum
        for i, (inputs, targets) in enumerate(step_batches):
            inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
            with gradient_sync(built.runnable, i == len(step_batches) - 1), loss_context(built.regions):
                with self.autocast:
                    micro_loss = token_loss_sum(built.family.logits(built.runnable, inputs), targets)  # sum over tokens
                (micro_loss * self.loss_scale).backward()
            loss_sum += plain(micro_loss.detach()).float()
        return loss_sum

    def _report_stall(self, step: int) -> None:
        """How long the newest save held the loop, on the slowest rank."""
        if self.checkpointer.last_stall_s is None:
            return
        stall = torch.tensor([self.checkpointer.last_stall_s], dtype=torch.float64, device=self.device)
        if self.world_size > 1:
            dist.all_reduce(stall, op=dist.ReduceOp.MAX)
        if self.rank == 0:
            metrics.emit(CheckpointStallEvent(step=step, stall_s=round(stall.item(), 4)))
        self.checkpointer.last_stall_s = None

    def _report(self, step: int, loss_sum: torch.Tensor,
                squares: torch.Tensor) -> tuple[float, bool, torch.Tensor, Gathered | None]:
        """One small all-reduce: the global loss (counted once per dp rank: on the last stage, by
        tp rank 0), whether any rank was asked to stop, whether any rank's generators moved
        (then every rank's are gathered again, for the step's end), and the gradient's squares."""
        counts_loss = self.coords.tp_rank == 0 and self.coords.pp_rank == self.dims.pp - 1
        moved = self.warm is not None and self.warm.moved()
        report = torch.stack([loss_sum if counts_loss else torch.zeros_like(loss_sum),
                              torch.tensor(float(self.stops.requested()), device=self.device),
                              torch.tensor(float(moved), device=self.device),
                              squares.to(loss_sum.dtype)])
        if self.world_size > 1:
            dist.all_reduce(report)
        gathered = self.warm.gather_if_moved(report[2].item() > 0) if self.warm is not None else None
        return report[0].item() / self.tokens_per_step, report[1].item() > 0, report[3].sqrt(), gathered

    def _evaluate_after(self, step: int) -> float | None:
        """The held-out loss every eval_every steps and at the job's last (trainer.evaluate)."""
        every = self.spec.training.eval_every
        if self.held_out is None or every is None or not (step % every == 0 or step == self.spec.training.steps):
            return None
        return evaluate(self.held_out, self.built, self.pipeline, self.autocast, self.coords, self.dims, self.device,
                        self.world_size)

    def _log_step(self, step: int, done: StepDone, eval_loss: float | None = None) -> None:
        """Every log_every steps, and the first and last of a segment (a change's downtime ends
        and starts there), or at a stop or an evaluation: rank 0's step event and metrics."""
        first_or_last = step in (self.end_step, self.resumed.step + 1)
        logged = step % self.spec.training.log_every == 0 or first_or_last or done.stop_now or eval_loss is not None
        if self.rank != 0 or not logged:
            return
        rate = self.tokens_per_step / done.elapsed_s
        numbers = self.board.numbers(rate) if self.board is not None else {}
        event = StepEvent(step=step, loss=done.loss, lr=done.lr, step_s=done.elapsed_s, tokens_per_s=rate,
                          data_wait_s=round(done.data_wait_s, 6), data_tokens_per_s=self.reader.tokens_per_s,
                          grad_norm=done.grad_norm, eval_loss=eval_loss, **numbers)
        metrics.emit(event)
        if self.board is not None:
            self.board.record(step, step_scalars(event, self.board.world_size))

    # -- finish -----------------------------------------------------------------------------

    def finish(self, ended: Ended) -> None:
        """The last save committed before anyone reports or exits (a planned change's step as
        a pending manifest where warm workers hold it), what a warm worker keeps, the final event."""
        step, position = ended.step, ended.position
        if ended.unsaved and not self.save.pending(step, position, ended.loss):
            self.save(step, position, ended.loss)
            ended.unsaved = False
        self.checkpointer.close()
        if self.warm is not None:
            self.warm.keep(self.built, self.layout, step, self.ckpt_group)
        if self.rank == 0:
            if ended.stopped:
                metrics.emit(StoppedEvent(step=step, samples_consumed=position.samples_consumed, pending=ended.unsaved))
            else:
                metrics.emit(FinishedEvent(step=step, samples_consumed=position.samples_consumed))

    def close(self) -> None:
        """Leave the process groups; what holds them goes first (`end_distributed`)."""
        self.built = self.save = self.resumed = self.ckpt_group = self.pipeline = None
        end_distributed(self.world_size)


def run(spec: JobSpec, plan: Plan, until_step: int | None, phases: Any) -> int:
    """A segment on this rank, step by step; the process's exit code."""
    trainer = Trainer(spec, plan, until_step, phases)
    try:
        trainer.setup()
        trainer.restore()
    except Fatal as error:
        if trainer.rank == 0:
            metrics.emit(FatalEvent(message=str(error)))
        trainer.close()
        return metrics.EXIT_FATAL
    trainer.start()
    ended = trainer.train()
    trainer.finish(ended)
    trainer.close()
    return 0
