"""Small records passed between tasks: references and numbers, never tensors or state dicts."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from parashift.specs.elastic import Outcome
from parashift.specs.words import counted
from parashift.trainer.events import perplexity
from pydantic import BaseModel, Field


class ModelSummary(BaseModel):
    """What profiling found about the model (for now: its size and cost per token)."""

    params: int
    flops_per_token: int
    device_kind: str
    profile_key: str = Field(description="the stored ModelProfile (op graph, rates, comm model)")


class SegmentResult(BaseModel):
    """One launch of the workers: which devices, which steps, how it went."""

    devices: int
    start_step: int
    final_step: int = Field(description="the last step committed (a failed segment's later steps are trained again)")
    outcome: Outcome = Field(
        description="finished: reached its last step; stopped: asked to stop; rescaled: stopped for a resource "
        "change; failed: a worker died or hung; fatal: an error no retry can fix (e.g. no usable checkpoint)"
    )
    reason: str | None = Field(default=None, description="why it stopped, rescaled or failed")
    losses: list[tuple[int, float]] = Field(default_factory=list)
    eval_losses: list[tuple[int, float]] = Field(default_factory=list, description="held-out loss by step")
    tokens_per_s: float | None = None
    mfu: float | None = Field(default=None, description="model FLOPs utilisation per device (median of its steps)")
    plan: str | None = Field(default=None, description="what ran: mesh, FSDP, activation checkpointing, micro-batches")
    checkpoint_urls: list[str] = Field(default_factory=list)
    resumed_from_url: str | None = Field(default=None, description="the checkpoint this segment started from")
    resumed_loss: float | None = Field(default=None, description="the loss recorded in that checkpoint")
    restore_bytes_per_s: float | None = Field(
        default=None, description="the restore's read rate, all ranks together (rank 0's bytes x ranks / its time)"
    )
    restore_bytes: dict[str, int] | None = Field(
        default=None, description="the restore's bytes over all ranks: needed, read, and where from (local: the "
        "readers' node-local tiers; live: warm workers' memory, of which network: another rank's; store: object storage)"
    )
    nodes: list[str] | None = Field(default=None, description="a job across nodes: the nodes of this segment")
    mesh: dict[str, int] = Field(default_factory=dict, description="the plan's mesh ({} on one device)")
    first_step_at: float | None = Field(default=None, description="when the flow heard this segment's first step "
                                        "done (Unix time; a change's downtime ends here)")
    last_step_at: float | None = Field(default=None, description="when the flow heard its last step done (Unix "
                                       "time; a change's downtime starts here)")
    left_nodes: list[str] = Field(default_factory=list, description="nodes that left during this segment")
    held_unsaved: bool = Field(default=False, description="stopped for a planned change with its last step held in "
                               "the warm workers' memory, described by a pending manifest: the next segment saves it")
    scalars_past_commit: list[tuple[int, dict[str, float]]] = Field(
        default_factory=list, description="a failed segment whose warm workers hold a step past its last commit: "
        "the TensorBoard scalars of each logged step after that commit, as rank 0 reported them (the held step's "
        "loss alone where rank 0 died in it). The job does not train them again, and a killed rank 0 may not have "
        "copied them to the store: the report fills what TensorBoard lacks (`trainer.scalars.fill_gaps`)")

    def __repr_args__(self) -> Iterator[tuple[str | None, Any]]:
        """Losses by step shortened to their count and ends: Prefect logs a failed launch's state
        with its result's repr at ERROR, in the run log and the UI (a segment of 10,000 steps
        was a line of ~280 kB); `model_dump` keeps every step."""
        for name, value in super().__repr_args__():
            yield name, _Steps(value) if name in ("losses", "eval_losses", "scalars_past_commit") and len(value) > 4 \
                else value

    @property
    def stopped(self) -> bool:
        """Asked to stop by the user (not by a resource change): the rest of the job waits."""
        return self.outcome == "stopped"

    @property
    def failed(self) -> bool:
        """Its workers died, hung or hit an error no retry fixes (the job may have recovered)."""
        return self.outcome in ("failed", "fatal")

    @property
    def ended(self) -> str:
        """How it ended, with why where there is a why: `finished`, `failed: rank 1 killed by signal 9`."""
        return f"{self.outcome}: {self.reason}" if self.reason else self.outcome


class _Steps:
    """A long list of (step, value) said by its length and its two ends."""

    def __init__(self, pairs: list[tuple[int, float]]) -> None:
        self.pairs = pairs

    def __repr__(self) -> str:
        return f"[{self.pairs[0]!r}, ... {len(self.pairs) - 2} more ..., {self.pairs[-1]!r}]"


class ReshardSummary(BaseModel):
    """What moving the newest checkpoint onto a plan reads (computed before the workers start)."""

    step: int
    devices: int
    bytes_needed: int
    bytes_read: int
    requests: int
    bytes_local: int

    @staticmethod
    def totals() -> tuple[str, ...]:
        return ("bytes_needed", "bytes_read", "requests", "bytes_local")


class TrainSummary(BaseModel):
    job_id: str
    steps: int
    final_loss: float | None
    first_loss: float | None
    tokens_per_s: float | None
    checkpoint_url: str | None
    mfu: float | None = None
    metrics_url: str | None = None
    wandb_url: str | None = Field(None, description="the job's offline W&B runs (metrics.wandb), for `wandb sync`")
    eval_loss: float | None = Field(None, description="the newest held-out loss (training.eval_every)")
    eval_step: int | None = None
    segments: list[SegmentResult]

    @property
    def eval_perplexity(self) -> float | None:
        return None if self.eval_loss is None else perplexity(self.eval_loss)

    @property
    def failures(self) -> list[str]:
        """One line per failed segment: a run that recovered still says what went wrong, and where."""
        return failed_segments(self.segments)


def failed_segments(segments: list[SegmentResult]) -> list[str]:
    """`segment 1 (3 devices, steps 0→10) failed: rank 1 killed by signal 9 ...`, one per failed segment."""
    return [f"segment {i} ({counted(s.devices, 'device')}, steps {s.start_step}→{s.final_step}) {s.ended}"
            for i, s in enumerate(segments, 1) if s.failed]
