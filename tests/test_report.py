"""The run's summary says which segment failed and why, though the job recovered."""

from __future__ import annotations

from parashift.tasks.records import ModelSummary, SegmentResult, TrainSummary
from parashift.tasks.report import summary_markdown

MODEL = ModelSummary(params=1000, flops_per_token=6000, device_kind="cpu", profile_key="p")


def recovered() -> TrainSummary:
    """3 devices until a worker died (last commit at step 10), then 2 devices to the end."""
    segments = [
        SegmentResult(devices=3, start_step=0, final_step=10, outcome="failed",
                      reason="rank 1 killed by signal 9 (torchrun exited with 1)", losses=[(1, 3.0), (12, 2.0)],
                      mesh={"dp": 3}, first_step_at=100.0, last_step_at=112.0),
        SegmentResult(devices=2, start_step=10, final_step=40, outcome="finished", losses=[(40, 1.5)],
                      mesh={"dp": 2}, first_step_at=114.25, last_step_at=140.0),
    ]
    return TrainSummary(job_id="job", steps=40, final_loss=1.5, first_loss=3.0, tokens_per_s=None,
                        checkpoint_url=None, segments=segments)


def test_the_summary_marks_the_failed_segment_with_its_reason() -> None:
    markdown = summary_markdown(recovered(), MODEL)
    assert "| segments | 2, 1 failed |" in markdown
    assert "| 1 | 3 |  | 0→10 | **failed**: rank 1 killed by signal 9 (torchrun exited with 1) |" in markdown
    assert "| 2 | 2 |  | 10→40 | finished |" in markdown


def test_a_reasons_pipe_does_not_split_its_row() -> None:
    summary = recovered()
    summary.segments[0].reason = "a | b"
    assert "| **failed**: a \\| b |" in summary_markdown(summary, MODEL)


def test_the_summary_lists_its_failures() -> None:
    assert recovered().failures == [
        "segment 1 (3 devices, steps 0→10) failed: rank 1 killed by signal 9 (torchrun exited with 1)"]
    assert TrainSummary(**{**recovered().model_dump(), "segments": recovered().segments[1:]}).failures == []


def test_each_change_shows_why_the_plans_and_its_downtime() -> None:
    markdown = summary_markdown(recovered(), MODEL)
    assert ("| 1 | failed: rank 1 killed by signal 9 (torchrun exited with 1) | 3 devices (dp 3) → 2 devices (dp 2) "
            "| 2.25 |") in markdown, markdown


def test_the_summary_says_where_the_offline_wandb_runs_are() -> None:
    assert "W&B" not in summary_markdown(recovered(), MODEL)
    summary = TrainSummary(**{**recovered().model_dump(), "wandb_url": "s3://bucket/jobs/job/metrics/wandb"})
    assert "| W&B (offline runs, `wandb sync`) | s3://bucket/jobs/job/metrics/wandb |" in summary_markdown(summary, MODEL)


def test_a_segment_is_said_short_and_kept_whole() -> None:
    """Prefect logs a failed launch's state, its SegmentResult's repr with it, at ERROR: a long
    segment's losses are said by their count and ends, and kept whole in the data."""
    losses = [(step, 3.0 - step / 1e4) for step in range(1, 10_001)]
    segment = SegmentResult(devices=4, start_step=0, final_step=10_000, outcome="failed", losses=losses,
                            eval_losses=[(5000, 2.5)])
    said = repr(segment)
    assert len(said) < 1000, len(said)
    assert "losses=[(1, 2.9999), ... 9998 more ..., (10000, 2.0)]" in said and "eval_losses=[(5000, 2.5)]" in said
    assert SegmentResult.model_validate(segment.model_dump()).losses == losses
