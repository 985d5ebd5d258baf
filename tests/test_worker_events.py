"""Worker events on the wire: one typed model per event, written and read by the same code;
whatever is not an event stays log text."""

from __future__ import annotations

import io
import json
import math

import pytest
from parashift.launcher.launch import LaunchResult
from parashift.trainer import metrics
from parashift.trainer.events import (
    PREFIX,
    CheckpointEvent,
    CheckpointStallEvent,
    CommTimingsEvent,
    FatalEvent,
    FinishedEvent,
    HeldEvent,
    RestoringEvent,
    StartEvent,
    StepEvent,
    StoppedEvent,
    encode,
    parse,
)

EVERY_KIND = [
    StartEvent(step=4, world_size=2, end_step=12, resumed=True, pids=[5, 6], nodes=["a", "a"], params=1000,
               flops_per_token=6000, checkpoint_url="file:///s/ckpt/00000004/manifest.json", checkpoint_loss=2.5,
               restore_s=0.2, restore_bytes={"needed": 10, "read": 10, "local": 0, "store": 10},
               phases={"boot_s": 1.5, "layout_s": None}),
    RestoringEvent(step=4, bytes_needed=10, bytes_read=12, requests=3, bytes_local=2),
    StepEvent(step=5, loss=2.4, lr=1e-3, step_s=0.02, tokens_per_s=11000.0),
    CheckpointEvent(step=8, url="file:///s/ckpt/00000008/manifest.json", stall_s=0.001, write_s=0.1,
                    bytes_written=4096),
    CheckpointStallEvent(step=9, stall_s=0.01),
    StoppedEvent(step=9, samples_consumed=72),
    FinishedEvent(step=12, samples_consumed=96),
    HeldEvent(step=11, samples_consumed=88, rank=1),
    FatalEvent(message="none of the 2 committed checkpoints fit"),
    CommTimingsEvent(timings={"group_size": 2, "all_reduce": [[16384, 1e-4]]}),
]


@pytest.mark.parametrize("event", EVERY_KIND, ids=lambda e: e.event)
def test_every_event_reads_back_as_written(event: object) -> None:
    line = encode(event)  # type: ignore[arg-type]
    assert line.startswith(PREFIX) and "\n" not in line and "received_at" not in line
    assert parse(line) == event
    assert parse(f"[rank0]:{line}") == event  # torchrun's prefix


def test_the_wire_format_is_a_json_object_behind_the_prefix() -> None:
    line = encode(StepEvent(step=3, loss=2.0, step_s=0.5, tokens_per_s=100.0))
    assert json.loads(line.removeprefix(PREFIX)) == {"event": "step", "step": 3, "loss": 2.0, "lr": None,
                                                     "step_s": 0.5, "tokens_per_s": 100.0, "data_wait_s": None,
                                                     "data_tokens_per_s": None, "grad_norm": None, "tflops": None,
                                                     "mfu": None, "memory_gib": None, "eval_loss": None}
    # lines written before the events were typed (keys sorted, fields left out) still read
    old = PREFIX + '{"event": "checkpoint", "step": 4, "url": "file:///x"}'
    assert parse(old) == CheckpointEvent(step=4, url="file:///x")


def test_a_diverged_loss_stays_an_event() -> None:
    event = parse(encode(StepEvent(step=3, loss=math.nan, step_s=0.5, tokens_per_s=100.0)))
    assert isinstance(event, StepEvent) and math.isnan(event.loss)


def test_what_is_not_an_event_stays_text() -> None:
    for line in ("plain text", PREFIX + "{not json", PREFIX + "[1, 2]", PREFIX + '{"event": "step", "step": 1}',
                 PREFIX + '{"event": "teleported", "step": 1}', PREFIX + '{"step": 1}'):
        assert parse(line) is None, line


def test_emit_writes_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    out = io.StringIO()
    monkeypatch.setattr("sys.stdout", out)
    metrics.emit(FinishedEvent(step=12, samples_consumed=96))
    assert out.getvalue() == encode(FinishedEvent(step=12, samples_consumed=96)) + "\n"


def test_a_launch_result_gives_typed_access() -> None:
    result = LaunchResult(returncode=0, events=list(EVERY_KIND))
    assert result.start is EVERY_KIND[0] and result.restoring is EVERY_KIND[1]
    assert [e.step for e in result.steps] == [5] and [e.step for e in result.checkpoints] == [8]
    assert result.fatal is not None and result.fatal.message.startswith("none of")
    assert result.stopped and result.final_step == 12
    assert result.of(CommTimingsEvent)[0].timings["group_size"] == 2
    assert LaunchResult(returncode=1).start is None and LaunchResult(returncode=1).final_step is None


def test_a_held_step_rank_0_did_not_complete_keeps_its_loss_from_the_rank_that_holds_it() -> None:
    """Found in a clean-clone run: rank 1 killed as step 10 began; rank 2 completed step 9 and
    held it, rank 0 never received the last chunk of step 9's reduction (it holds step 8). The
    job resumed at step 9, and the failed segment's losses ended at step 8: step 9 was trained
    and its loss recorded nowhere. The holder's event carries it."""
    steps = [StepEvent(step=s, loss=float(s), step_s=0.1, tokens_per_s=1.0) for s in (7, 8)]
    said = [HeldEvent(step=8, rank=0, loss=8.0), HeldEvent(step=9, rank=2, loss=9.5)]
    assert LaunchResult(returncode=-9, events=[*steps, *said]).losses() == [(7, 7.0), (8, 8.0), (9, 9.5)]
    reported = [*steps, StepEvent(step=9, loss=9.5, step_s=0.1, tokens_per_s=1.0)]
    assert LaunchResult(returncode=-9, events=[*reported, *said]).losses() == [(7, 7.0), (8, 8.0), (9, 9.5)]  # once
    assert LaunchResult(returncode=-9, events=[*steps, *said], lost_ranks=[2]).losses() == [(7, 7.0), (8, 8.0)]


def test_a_held_step_counts_only_from_a_rank_that_outlived_the_segment() -> None:
    """A survivor of a peer's death can say it holds a step and be ended a moment later (a
    hang's watchdog ends every rank that has not answered): the step went with it, and the
    flow must not announce a resume there."""
    said = [HeldEvent(step=8, rank=0), HeldEvent(step=8, rank=1)]
    assert LaunchResult(returncode=-9, events=said, lost_ranks=[2]).held_step() == 8
    assert LaunchResult(returncode=-9, events=said, lost_ranks=[1, 2]).held_step() == 8  # rank 0 still holds it
    assert LaunchResult(returncode=-9, events=said, lost_ranks=[0, 1, 2]).held_step() is None
    assert LaunchResult(returncode=0, events=[StepEvent(step=3, loss=2.0, step_s=0.5, tokens_per_s=1.0)]).held_step() is None
