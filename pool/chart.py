"""A pool's allocations over time as a PNG: devices per job, stacked, one step per decision."""

from __future__ import annotations

import io

from parashift.pool.state import Decision


def allocation_png(pool: str, devices: int, decisions: list[Decision], now: float) -> bytes:
    import matplotlib

    matplotlib.use("Agg")  # no display: render to memory
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 3.4), dpi=110)
    axes = figure.add_subplot()
    if decisions:
        start = decisions[0].at
        jobs = list(dict.fromkeys(job for d in decisions for job in d.devices))
        times = [d.at - start for d in decisions] + [max(now - start, decisions[-1].at - start)]
        series = [[d.devices.get(job, 0) for d in decisions] + [decisions[-1].devices.get(job, 0)] for job in jobs]
        axes.stackplot(times, series, labels=jobs, step="post", alpha=0.85)
        axes.legend(fontsize=7, loc="upper right")
    axes.axhline(devices, color="black", linewidth=0.8, linestyle="--")
    axes.set_ylim(0, devices + 0.5)
    axes.set_xlabel("seconds since the first decision")
    axes.set_ylabel("devices")
    axes.set_title(f"pool {pool}: devices per job ({devices} in all)")
    axes.grid(alpha=0.3)
    figure.tight_layout()
    out = io.BytesIO()
    figure.savefig(out, format="png")
    return out.getvalue()
