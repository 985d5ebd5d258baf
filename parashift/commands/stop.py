"""`parashift stop SPEC`: ask a running job to stop at its next step boundary."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import typer


def stop(
    spec_file: Path = typer.Argument(..., help="the job's spec YAML"),
    reason: str = typer.Option("manual", help="recorded in the stop request"),
) -> None:
    """Write the job's stop request; its workers checkpoint and exit within a few seconds."""
    from specs import SpecError, load_spec
    from storage import JobPaths, ObjectStore

    try:
        spec = load_spec(spec_file)
    except SpecError as error:
        for line in error.lines():
            typer.echo(line, err=True)
        raise typer.Exit(1) from None
    store = ObjectStore(spec.storage.url, dict(spec.storage.storage_options))
    key = JobPaths(spec.job_id).stop()
    store.put_json(key, {"reason": reason, "requested_at": datetime.now(UTC).isoformat()})
    typer.echo(f"stop requested: {store.url_for(key)}")
