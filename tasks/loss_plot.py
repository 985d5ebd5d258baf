"""The loss curve as a PNG, each change of the device count marked where it happened."""

from __future__ import annotations

import io

from parashift.tasks.records import SegmentResult


def loss_curve_png(job_id: str, segments: list[SegmentResult]) -> bytes:
    """Loss per step, one colour per segment, a dashed line at each reconfiguration labelled
    with its device counts and reason."""
    import matplotlib

    matplotlib.use("Agg")  # no display: render to memory
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 3.6), dpi=110)
    axes = figure.add_subplot()
    for i, segment in enumerate(segments):
        if segment.losses:
            steps, losses = zip(*segment.losses, strict=True)
            axes.plot(steps, losses, linewidth=1.4, label=f"{segment.devices} device{'s' * (segment.devices != 1)}" if i < 8 else None)
        if i and segment.devices != segments[i - 1].devices:
            previous = segments[i - 1]
            axes.axvline(segment.start_step, color="grey", linestyle="--", linewidth=0.9)
            why = f" ({previous.reason.split(':')[0]})" if previous.reason else ""
            axes.annotate(f"{previous.devices}→{segment.devices}{why}", (segment.start_step, 1.0),
                          xycoords=("data", "axes fraction"), xytext=(3, -12), textcoords="offset points",
                          fontsize=8, color="dimgrey")
    axes.set_xlabel("step")
    axes.set_ylabel("loss")
    axes.set_title(f"{job_id}: loss per step")
    axes.grid(alpha=0.3)
    if any(s.losses for s in segments):
        axes.legend(fontsize=8, loc="upper right")
    figure.tight_layout()
    out = io.BytesIO()
    figure.savefig(out, format="png")
    return out.getvalue()
