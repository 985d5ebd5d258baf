"""publish_report: the run's summary and loss curve as Prefect artifacts; the curve's image is
also kept in the job's storage (`jobs/{job}/reports/loss-curve.png`)."""

from __future__ import annotations

import base64
import itertools

from parashift.specs import JobSpec
from parashift.specs.words import counted
from parashift.storage import JobPaths, StorageError, is_pending_manifest, open_store
from parashift.tasks.artifacts import artifact_key
from parashift.tasks.credentials import environment, storage_environment
from parashift.tasks.loss_plot import loss_curve_png
from parashift.tasks.records import ModelSummary, SegmentResult, TrainSummary
from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.logging import get_run_logger

_SPARKS = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float]) -> str:
    if not values:
        return ""
    lo, hi = min(values), max(values)
    span = (hi - lo) or 1.0
    return "".join(_SPARKS[int((v - lo) / span * (len(_SPARKS) - 1))] for v in values)


def summarize(spec: JobSpec, segments: list[SegmentResult]) -> TrainSummary:
    losses = [loss for seg in segments for _, loss in seg.losses]
    rates = [seg.tokens_per_s for seg in segments if seg.tokens_per_s]
    mfus = [seg.mfu for seg in segments if seg.mfu]
    urls = [url for seg in segments for url in ([seg.resumed_from_url] if seg.resumed_from_url else []) + seg.checkpoint_urls
            if not is_pending_manifest(url)]  # a step held in warm workers' memory is no checkpoint
    evals = [item for seg in segments for item in seg.eval_losses]
    if not losses and segments and segments[-1].resumed_loss is not None:
        losses = [segments[-1].resumed_loss]  # nothing left to train: report the committed state
    metrics = open_store(spec.storage).url_for(JobPaths(spec.job_id).job_key("metrics"))
    return TrainSummary(
        job_id=spec.job_id,
        steps=segments[-1].final_step if segments else 0,
        first_loss=losses[0] if losses else None,
        final_loss=losses[-1] if losses else None,
        tokens_per_s=rates[-1] if rates else None,
        checkpoint_url=urls[-1] if urls else None,
        mfu=mfus[-1] if mfus else None,
        eval_loss=evals[-1][1] if evals else None,
        eval_step=evals[-1][0] if evals else None,
        metrics_url=metrics if spec.metrics.tensorboard else None,
        wandb_url=f"{metrics}/wandb" if spec.metrics.wandb else None,
        segments=segments,
    )


def summary_markdown(summary: TrainSummary, model: ModelSummary) -> str:
    curve = [loss for seg in summary.segments for _, loss in seg.losses]

    def fmt(value: float | None, pattern: str) -> str:
        return "n/a" if value is None else format(value, pattern)

    lines = [
        f"# Training summary: `{summary.job_id}`",
        "",
        "| | |",
        "|---|---|",
        f"| steps | {summary.steps} |",
        f"| parameters | {model.params:,} |",
        f"| first loss | {fmt(summary.first_loss, '.4f')} |",
        f"| final loss | {fmt(summary.final_loss, '.4f')} |",
        f"| tokens/s (median, last segment) | {fmt(summary.tokens_per_s, ',.0f')} |",
        f"| MFU (median, last segment) | {fmt(summary.mfu, '.1%')} |",
        f"| held-out loss (perplexity) | {fmt(summary.eval_loss, '.4f')} ({fmt(summary.eval_perplexity, '.2f')})"
        f"{f' at step {summary.eval_step}' if summary.eval_step else ''} |",
        f"| TensorBoard | {summary.metrics_url or 'off'} |",
        *([f"| W&B (offline runs, `wandb sync`) | {summary.wandb_url} |"] if summary.wandb_url else []),
        f"| last checkpoint | {summary.checkpoint_url or 'none'} |",
        f"| segments | {len(summary.segments)}{f', {len(summary.failures)} failed' if summary.failures else ''} |",
        "",
        f"loss: `{sparkline(curve)}`",
        "",
        *segments_table(summary.segments),
        *changes_table(summary.segments),
    ]
    restores = [s for s in summary.segments if s.restore_bytes and s.restore_bytes.get("read")]
    if restores:  # where each resume read its state from
        lines += ["", "| segment | nodes | restored at step | MB read | MB from node-local tiers | "
                  "MB from live workers (from other ranks) | MB from object storage |",
                  "|---|---|---|---|---|---|---|"]
        for i, s in enumerate(summary.segments):
            if s in restores:
                b = s.restore_bytes or {}
                lines.append(f"| {i + 1} | {', '.join(s.nodes) if s.nodes else 'this machine'} | {s.start_step} | "
                             f"{b['read'] / 1e6:,.2f} | {b['local'] / 1e6:,.2f} | {b.get('live', 0) / 1e6:,.2f} "
                             f"({b.get('network', 0) / 1e6:,.2f}) | {b['store'] / 1e6:,.2f} |")
    return "\n".join(lines)


def changes_table(segments: list[SegmentResult]) -> list[str]:
    """One row per change between segments: why, the plan before and after, and the downtime
    (the last step heard under the old plan to the first heard under the new one)."""
    if len(segments) < 2:
        return []
    rows = ["", "| change | why | plan before → after | downtime s |", "|---|---|---|---|"]
    for i, (old, new) in enumerate(itertools.pairwise(segments), 1):
        down = (f"{new.first_step_at - old.last_step_at:.2f}"
                if new.first_step_at is not None and old.last_step_at is not None else "–")
        why = old.ended.replace("|", "\\|")
        rows.append(f"| {i} | {why} | {_mesh(old)} → {_mesh(new)} | {down} |")
    return rows


def _mesh(segment: SegmentResult) -> str:
    axes = " × ".join(f"{axis} {n}" for axis, n in segment.mesh.items())
    return counted(segment.devices, 'device') + (f" ({axes})" if axes else "")


def segments_table(segments: list[SegmentResult]) -> list[str]:
    """The segments as markdown rows: a failed one in bold with its reason, so that a run that
    recovered still shows which launch went wrong and why."""
    rows = ["| segment | devices | plan | steps | outcome |", "|---|---|---|---|---|"]
    for i, s in enumerate(segments, 1):
        ended = s.ended.replace("|", "\\|")  # a reason's pipe would split the row
        if s.failed:
            ended = f"**{s.outcome}**{ended[len(s.outcome):]}"
        rows.append(f"| {i} | {s.devices} | {s.plan or ''} | {s.start_step}→{s.final_step} | {ended} |")
    return rows


def fill_metrics_gaps(spec: JobSpec, segments: list[SegmentResult]) -> None:
    """Steps a killed rank 0 logged but had not copied to the store, which warm workers resumed
    past (`SegmentResult.scalars_past_commit`): recorded from its reports where TensorBoard lacks
    them. Off the change's path (at the job's end), and it never fails a trained job."""
    records = [record for segment in segments for record in segment.scalars_past_commit]
    if not records or not spec.metrics.tensorboard:
        return
    from parashift.trainer.scalars import fill_gaps  # torch: imported only for a job that needs it

    try:
        with environment(storage_environment(spec)):
            filled = fill_gaps(open_store(spec.storage), spec.job_id, records)
    except Exception as error:  # noqa: BLE001 - metrics never fail a job
        get_run_logger().warning("TensorBoard's missing steps could not be recorded: %s", error)
        return
    if filled:
        get_run_logger().info("TensorBoard: step%s %s recorded from rank 0's reports (it died before copying them)",
                              "s" if len(filled) > 1 else "", ", ".join(map(str, filled)))


@task(name="publish-report")
def publish_report(spec: JobSpec, model: ModelSummary, segments: list[SegmentResult]) -> TrainSummary:
    """Fill what TensorBoard lacks of steps the job will not train again; summarize the run;
    publish the summary (markdown) and the loss curve (table)."""
    fill_metrics_gaps(spec, segments)
    summary = summarize(spec, segments)
    create_markdown_artifact(
        key=artifact_key(spec.job_id, "summary"),
        markdown=summary_markdown(summary, model),
        description=f"Training summary of {spec.job_id}",
    )
    create_table_artifact(
        key=artifact_key(spec.job_id, "loss-curve"),
        table=[{"step": step, "loss": loss, "devices": seg.devices} for seg in segments for step, loss in seg.losses],
        description=f"Loss per step of {spec.job_id}",
    )
    if any(seg.losses for seg in segments):
        png = loss_curve_png(spec.job_id, segments)
        key = JobPaths(spec.job_id).job_key("reports", "loss-curve.png")
        stored = None
        try:
            with environment(storage_environment(spec)):
                store = open_store(spec.storage)
                store.put(key, png)
                stored = store.url_for(key)
        except StorageError as error:  # the report must not fail a trained job
            get_run_logger().warning("could not keep the loss curve image in storage: %s", error)
        # The image inside the artifact itself (a data URI): the UI shows it with no access to storage.
        encoded = base64.b64encode(png).decode()
        create_markdown_artifact(
            key=artifact_key(spec.job_id, "loss-curve-image"),
            markdown=f"![loss per step of {spec.job_id}](data:image/png;base64,{encoded})"
                     + (f"\n\n`{stored}`" if stored else ""),
            description=f"Loss curve of {spec.job_id}, device changes marked",
        )
    return summary
