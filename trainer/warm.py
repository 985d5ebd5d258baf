"""What a warm worker (`launcher.warm_pool`) adds to a segment: peers' state from the segment
before, every rank's generators followed step by step, the step held after a peer's death, the
step kept in memory for a planned change, and the state kept for the next segment."""


from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from parashift.specs import JobSpec, environ
from parashift.trainer import metrics
from parashift.trainer.build import Built
from parashift.trainer.checkpoint import live as live_state
from parashift.trainer.checkpoint.group import broadcast
from parashift.trainer.control import StopRequests
from parashift.trainer.events import (
    HeldEvent,
)
from parashift.trainer.saves import Ended, Saves
from parashift.trainer.state import (
    collect_state,
    generator_states,
    held_by_kept,
    rank_private,
)

log = logging.getLogger("parashift.worker")


def is_warm_worker() -> bool:
    """Whether this process is a warm worker (`launcher.warm_pool`), booted before this job and
    serving others after it."""
    return os.environ.get(environ.WARM_WORKER) == "1"


def every_ranks_own(state: dict[str, torch.Tensor], world_size: int, group: Any) -> dict[str, torch.Tensor]:
    """Every rank's own state (its generator states: a few KB each), gathered on every rank
    (a collective): a warm worker that holds them all can serve a rank that died."""
    mine = {name: t.detach().cpu() for name, t in state.items() if rank_private(name) is not None}
    if world_size == 1:
        return mine
    everyone: list[Any] = [None] * world_size
    dist.all_gather_object(everyone, mine, group=group)  # in memory between this job's ranks; nothing from storage
    return {name: t for said in everyone for name, t in said.items()}


@dataclass(frozen=True)
class Gathered:
    """Generator states gathered at one moment: this rank's, and every rank's own."""

    mine: dict[str, torch.Tensor]
    every: dict[str, torch.Tensor]


class PeersGenerators:
    """Every rank's generator states as of step `step`, kept by every warm rank: what a survivor
    of a peer's death needs to hold that step whole (the dead rank's generators included).
    Gathered at the start, and again after a step that moved any rank's generator (a flag in the
    step's report: no collective while none moves, as in a model without dropout)."""

    def __init__(self, rank: int, device: torch.device, world_size: int, step: int) -> None:
        self.rank, self.device, self.world_size = rank, device, world_size
        self.set(step, self.gather())

    def gather(self) -> Gathered:
        """Every rank's generator states now: a collective on the default group (the loop's; the
        checkpoint's group is the saver's). Kept by `set` once the step they end is whole: a
        death during the gather, or before the update, leaves the step before as it was."""
        mine = generator_states(self.rank, self.device)
        return Gathered(mine, every_ranks_own(mine, self.world_size, None))

    def set(self, step: int, gathered: Gathered) -> None:
        self.step, self.mine, self.every = step, gathered.mine, gathered.every

    def moved(self) -> bool:
        """Whether this rank's generators moved since the last gather."""
        now = generator_states(self.rank, self.device)
        return any(not torch.equal(now[name], self.mine[name]) for name in now)


def hold_after_failure(spec: JobSpec, built: Built, layout: Any, save: Saves, where: Ended,
                       generators: PeersGenerators) -> None:
    """A warm worker whose peer died: keep the state of the last step it completed for the job's
    next segment (`trainer.checkpoint.live`), and say so where it holds that step whole."""
    rank, device = generators.rank, generators.device
    state = {**collect_state(built.module, built.optimizer, rank, device, local=True), **generators.mine}
    facts = live_state.Unrecorded(layout, *save.manifest_fields(where.position, where.loss))
    held = live_state.hold(spec.job_id, where.step, layout, rank, state, others=generators.every, unrecorded=facts)
    if held.whole():
        metrics.emit(HeldEvent(step=where.step, samples_consumed=where.position.samples_consumed, rank=rank,
                               loss=where.loss))


def holds_for_next(stops: StopRequests, layout: Any, rank: int, world_size: int, device: torch.device) -> bool:
    """At a stop: whether the ranks keep the step in memory for the next segment instead of
    saving it first, decided by rank 0 for all. Only warm workers, only for a planned change
    (the stop object names the next device count), and only where the ranks whose processes
    the next segment keeps (`trainer.state.held_by_kept`) hold every box it can need."""
    devices = stops.next_devices() if rank == 0 and is_warm_worker() else None
    decision = torch.tensor([1.0 if devices is not None and held_by_kept(layout, devices) else 0.0], device=device)
    if world_size > 1:
        dist.broadcast(decision, src=0)
    return decision.item() > 0


class WarmHooks:
    """A warm worker's part in one segment, called by `trainer.trainer.Trainer` at its steps.
    None of it runs in a process that serves a single job (torchrun's workers)."""

    def __init__(self, spec: JobSpec, rank: int, world_size: int, device: torch.device) -> None:
        self.spec, self.rank, self.world_size, self.device = spec, rank, world_size, device
        self.generators: PeersGenerators | None = None

    def peers(self, checkpoints: Any, group: Any) -> live_state.LivePeers | None:
        """What every rank holds from the segment before, said once (the restore takes those
        boxes from memory; None where none holds any); a failure's survivors' step is recorded
        where nothing describes it yet."""
        live = live_state.LivePeers.gather(self.spec.job_id, self.rank, group)
        if live is not None and live.recorders:
            newest = broadcast(max(checkpoints.manifest_steps(), default=-1) if self.rank == 0 else None, group)
            live.record(checkpoints, self.rank, newest)
        return live

    def follow(self, step: int) -> None:
        """Follow every rank's generators from `step` on (with peers to serve only)."""
        if self.world_size > 1:
            self.generators = PeersGenerators(self.rank, self.device, self.world_size, step)

    @property
    def follows(self) -> bool:
        """Whether a peer's death may be survived mid-step (the loop may leave a step)."""
        return self.generators is not None

    def moved(self) -> bool:
        """Whether this rank's generators moved in the step just done (a flag in its report)."""
        return self.generators is not None and self.generators.moved()

    def gather_if_moved(self, any_moved: bool) -> Gathered | None:
        """At a step's report, before its update: every rank's generators gathered again where
        any moved (None: nobody's moved, what was gathered is this step's too)."""
        return self.generators.gather() if self.generators is not None and any_moved else None

    def stepped(self, step: int, gathered: Gathered | None) -> None:
        """After the step's update: its generators are those of step `step`."""
        if self.generators is not None:
            self.generators.set(step, gathered if gathered is not None else
                                Gathered(self.generators.mine, self.generators.every))

    def holds_for_next(self, stops: StopRequests, layout: Any) -> bool:
        return holds_for_next(stops, layout, self.rank, self.world_size, self.device)

    def after_failure(self, built: Built, layout: Any, save: Saves, where: Ended) -> None:
        """A peer died: hold the last step this rank completed, if it holds it whole."""
        generators = self.generators
        if generators is None or not where.consistent or generators.step != where.step:
            return
        try:
            hold_after_failure(self.spec, built, layout, save, where, generators)
        except Exception as error:  # noqa: BLE001 - the job resumes from its last commit instead
            log.warning("rank %d: step %d not held after the failure (%s)", self.rank, where.step, error)

    def keep(self, built: Built, layout: Any, step: int, group: Any) -> None:
        """The committed (or pending) state stays in this process for the job's next segment."""
        state = collect_state(built.module, built.optimizer, self.rank, self.device, local=True)
        live_state.hold(self.spec.job_id, step, layout, self.rank, state,
                        others=every_ranks_own(state, self.world_size, group))
