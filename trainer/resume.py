"""Where a segment starts: the newest usable state for this rank's boxes, from whatever plan
saved it (storage, a node's tier, or warm peers' memory), else the initial weights."""


from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from parashift.ptc.reconfig import LIVE, LOCAL, RankReads
from parashift.specs import JobSpec
from parashift.storage import JobPaths
from parashift.trainer import metrics
from parashift.trainer.build import Built
from parashift.trainer.checkpoint import (
    Restored,
    restore_latest,
)
from parashift.trainer.checkpoint import live as live_state
from parashift.trainer.data import (
    DataPosition,
)
from parashift.trainer.events import (
    RestoringEvent,
)
from parashift.trainer.parallel import (
    initialize,
)
from parashift.trainer.state import (
    OptimizerState,
    apply_state,
    restore_destinations,
)


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


def restored_url(store: Any, job_id: str, restored: Restored | None) -> str | None:
    """The manifest a segment started from: a committed one, or a pending one (live memory)."""
    if restored is None:
        return None
    paths = JobPaths(job_id)
    return store.url_for(paths.pending_manifest(restored.step) if restored.pending else paths.manifest(restored.step))
