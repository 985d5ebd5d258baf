"""What workers report: one pydantic model per event, a union discriminated by `event`.

Rank 0 writes each event as one line, `PREFIX` + JSON, on its stdout (`trainer.metrics.emit`);
the launcher (`launcher.launch`), the log relay (`tasks.worker_log`) and the job's flow read
them back through `parse`, the same models. A line that is not an event, or an event this
code does not know (a malformed one, a newer worker's), stays log text.

Pydantic and the standard library only: the launcher side imports this without torch.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

PREFIX = "PARASHIFT "


class _Event(BaseModel):
    # A diverging run's loss is NaN: written as NaN (as json.dumps does), read back as NaN.
    model_config = ConfigDict(ser_json_inf_nan="constants")

    received_at: float | None = Field(
        None, description="when a launcher heard it (seconds since 1970; set by a node's launcher, never by a worker)")


class StartEvent(_Event):
    """The workers are up and restored (or start from scratch); they train from `step`."""

    event: Literal["start"] = "start"
    step: int
    world_size: int
    end_step: int | None = None
    resumed: bool = False
    pids: list[int] = Field(default_factory=list, description="by rank")
    nodes: list[str] = Field(default_factory=list, description="each rank's node")
    params: int | None = None
    flops_per_token: int | None = None
    checkpoint_url: str | None = Field(None, description="the manifest restored")
    checkpoint_loss: float | None = Field(None, description="the loss recorded in that checkpoint")
    restore_s: float | None = None
    restore_bytes: dict[str, int] | None = Field(
        None, description="over all ranks: needed, read, and where from: local (node tiers), live (workers' memory), store")
    phases: dict[str, float | None] = Field(default_factory=dict, description="seconds of each start-up phase")


class RestoringEvent(_Event):
    """Rank 0 reads its share of the checkpoint of `step`."""

    event: Literal["restoring"] = "restoring"
    step: int
    bytes_needed: int
    bytes_read: int
    requests: int
    bytes_local: int = 0
    bytes_live: int = Field(0, description="from live workers' memory (its own or a peer's, over the process group)")
    durable_step: int | None = Field(None, description="`step` is held in memory, not saved: the newest committed step")


class StepEvent(_Event):
    """One optimizer step done (every `log_every` steps and the last)."""

    event: Literal["step"] = "step"
    step: int
    loss: float
    lr: float | None = None
    step_s: float
    tokens_per_s: float
    data_wait_s: float | None = Field(None, description="of step_s, how long rank 0 waited for its data")
    data_tokens_per_s: float | None = Field(None, description="rank 0's reader: tokens read per second of reading")
    grad_norm: float | None = Field(None, description="the gradients' global norm before clipping")
    tflops: float | None = Field(None, description="model TFLOP/s per device (6N + attention per token)")
    mfu: float | None = Field(None, description="model FLOPs utilisation: tflops / the device's peak")
    memory_gib: float | None = Field(None, description="rank 0's peak memory (CUDA allocator, or resident set)")
    eval_loss: float | None = Field(None, description="the held-out loss after this step (training.eval_every)")


class CheckpointEvent(_Event):
    """The checkpoint of `step` is committed (written in the background)."""

    event: Literal["checkpoint"] = "checkpoint"
    step: int
    url: str | None = Field(None, description="its manifest")
    stall_s: float = 0.0
    write_s: float = 0.0
    bytes_written: int = 0  # rank 0's own object
    bytes_total: int = Field(0, description="the checkpoint's size: every rank's object")
    ranks: int = Field(0, description="the ranks that wrote an object")


class CheckpointStallEvent(_Event):
    """The training loop waited for a checkpoint before step `step`."""

    event: Literal["checkpoint_stall"] = "checkpoint_stall"
    step: int
    stall_s: float


class StoppedEvent(_Event):
    """Asked to stop: the workers stopped at `step`, committed, or (`pending`: a planned change
    on warm workers) held in their memory for the next segment, which saves it."""

    event: Literal["stopped"] = "stopped"
    step: int
    samples_consumed: int = 0
    pending: bool = False


class HeldEvent(_Event):
    """A warm worker's peer died: this rank keeps the state of `step`, the last step it
    completed, whole in its memory for the job's next segment, which resumes there
    (`trainer.checkpoint.live`). Said by every such rank, not only rank 0 (which may be the
    one that died)."""

    event: Literal["held"] = "held"
    step: int
    samples_consumed: int = 0
    rank: int | None = Field(None, description="the rank that holds it (its process must outlive the segment)")
    loss: float | None = Field(None, description="that step's loss over the global batch (every rank has it from "
                                                 "the step's report): the step's record where rank 0 did not "
                                                 "complete the step that another rank holds")


class FinishedEvent(_Event):
    """The workers reached their last step, committed."""

    event: Literal["finished"] = "finished"
    step: int
    samples_consumed: int = 0


class FatalEvent(_Event):
    """An error no retry can fix (the workers exit with `trainer.metrics.EXIT_FATAL`)."""

    event: Literal["fatal"] = "fatal"
    message: str


class CommTimingsEvent(_Event):
    """`trainer.measure_comm`: the collectives' timings (`planner.comm.comm_model_from_timings`)."""

    event: Literal["comm_timings"] = "comm_timings"
    timings: dict[str, Any]


WorkerEvent = Annotated[
    StartEvent | RestoringEvent | StepEvent | CheckpointEvent | CheckpointStallEvent | StoppedEvent | FinishedEvent
    | HeldEvent | FatalEvent | CommTimingsEvent,
    Field(discriminator="event"),
]
_WORKER_EVENT: TypeAdapter[WorkerEvent] = TypeAdapter(WorkerEvent)


def perplexity(loss: float) -> float:
    """exp(loss), capped where a float would overflow (a diverged run's loss)."""
    return math.exp(min(loss, 700.0))


# The name's end of an event file the job's report writes for steps a killed rank 0 lost
# (`trainer.scalars.fill_gaps`); its wall times are the fill's, not the steps' (pool.step_times).
FILLED_SUFFIX = ".filled"


def step_scalars(event: StepEvent, devices: int) -> dict[str, float]:
    """A logged step's TensorBoard scalars, from rank 0's report of it (what is not known is left
    out): what rank 0 records (`trainer.scalars`), and what the flow records for it where rank 0
    could not (`trainer.scalars.fill_gaps`)."""
    values = {"loss": event.loss, "grad_norm": event.grad_norm, "lr": event.lr, "tokens_per_s": event.tokens_per_s,
              "tflops": event.tflops, "mfu": event.mfu, "memory_gib": event.memory_gib,
              "data_wait_s": event.data_wait_s,
              # per device count: what a pool learns a job's speed from (pool/step_times.py)
              "step_s": event.step_s, "devices": float(devices), "eval_loss": event.eval_loss,
              "eval_perplexity": perplexity(event.eval_loss) if event.eval_loss is not None else None}
    return {name: value for name, value in values.items() if value is not None}


def encode(event: WorkerEvent) -> str:
    """The line that carries `event` (without its newline)."""
    return PREFIX + event.model_dump_json(exclude={"received_at"} if event.received_at is None else None)


def parse(line: str) -> WorkerEvent | None:
    """The event a worker line carries, or None for log text. torchrun may prefix lines with
    `[rank]:`, so the prefix is searched, not matched at the start."""
    at = line.find(PREFIX)
    if at < 0:
        return None
    try:
        return _WORKER_EVENT.validate_json(line[at + len(PREFIX):])
    except ValidationError:
        return None


__all__ = ["FILLED_SUFFIX", "PREFIX", "CheckpointEvent", "CheckpointStallEvent", "CommTimingsEvent", "FatalEvent", "FinishedEvent",
           "HeldEvent", "RestoringEvent", "StartEvent", "StepEvent", "StoppedEvent", "WorkerEvent", "encode", "parse",
           "perplexity", "step_scalars"]
