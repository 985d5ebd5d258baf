"""`parashift stop SPEC`: ask a running job to stop at its next step boundary."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import typer

from parashift.commands.spec import held_by_a_run, load_spec_or_exit


def stop(
    spec_file: Path = typer.Argument(..., help="the job's spec YAML"),
    reason: str = typer.Option("manual", help="recorded in the stop request"),
) -> None:
    """Write the job's stop request; its workers checkpoint and exit within a few seconds."""
    from parashift.storage import JobPaths, open_store

    spec = load_spec_or_exit(spec_file)
    store = open_store(spec.storage)
    key = JobPaths(spec.job_id).stop()
    store.put_json(key, {"reason": reason, "requested_at": datetime.now(UTC).isoformat()})
    typer.echo(f"stop requested: {store.url_for(key)}")
    if held_by_a_run(spec):
        return  # it stops at its next step boundary
    typer.echo(f"no run of {spec.job_id} holds its lease now: a run starting now stops at its first step; "
               "one started later ignores this request (it is older than that run)")
