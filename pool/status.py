"""What a pool is doing, read from its state in storage: `parashift pool POOL --status`, the
terminal's view of what the UI's artifacts show (each job's devices and progress, and why the
last decision gave each what it has), without a Prefect server or the controller running."""

from __future__ import annotations

import time

from parashift.pool.state import PoolState
from parashift.specs.words import counted


def status_rows(state: PoolState) -> list[dict[str, str]]:
    """One row per job, in submission order."""
    last = state.decisions[-1] if state.decisions else None
    rows = []
    for record in sorted(state.jobs.values(), key=lambda r: r.submitted_at):
        res, steps = record.spec.resources, record.spec.training.steps
        where = f" ({','.join(record.nodes)})" if record.nodes else ""
        low, high = record.spec.device_bounds()
        why = record.reason if record.status in ("finished", "failed") else (last.reasons.get(record.job_id) if last else None)
        rows.append({"job": record.job_id, "status": record.status, "devices": f"{record.devices}{where}",
                     "steps": f"{record.steps_done}/{steps}", "priority": str(res.priority),
                     "bounds": f"{low}..{high}", "why": why or ""})
    return rows


def status_line(state: PoolState, pending: int, now: float | None = None) -> str:
    """The pool in one line: its devices, its jobs by status, what waits to be taken in, and
    when it last decided."""
    by_status: dict[str, int] = {}
    for record in state.jobs.values():
        by_status[record.status] = by_status.get(record.status, 0) + 1
    allocated = sum(r.devices for r in state.jobs.values() if r.status in ("waiting", "running"))
    jobs = ", ".join(f"{n} {status}" for status, n in sorted(by_status.items())) or "none yet"
    line = f"pool {state.pool}: {counted(state.devices, 'device')} ({allocated} allocated), jobs: {jobs}"
    if pending:
        line += f"; {counted(pending, 'submission')} not taken in yet (the controller takes them at its next look)"
    if state.decisions:
        at = state.decisions[-1].at
        ago = (now if now is not None else time.time()) - at
        line += (f"; last decision at {time.strftime('%H:%M:%S', time.gmtime(at))} UTC ({ago:.0f} s ago), "
                 f"on: {state.decisions[-1].event}")
    if state.nodes_down:
        line += f"; {counted(len(state.nodes_down), 'node')} down: {', '.join(state.nodes_down)}"
    return line
