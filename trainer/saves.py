"""The job's checkpoints from this rank, and where the training loop stands (what is saved,
held, or reported when it ends)."""


from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from parashift.specs import JobSpec
from parashift.specs.plan import Plan
from parashift.storage import StorageError
from parashift.trainer.build import Built
from parashift.trainer.checkpoint import (
    Checkpointer,
)
from parashift.trainer.data import (
    DataPosition,
)
from parashift.trainer.layout import layout_mismatches
from parashift.trainer.state import (
    collect_state,
)

log = logging.getLogger("parashift.worker")


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
