"""`parashift plan` (placeholder until the planner lands)."""

from __future__ import annotations

import typer


def plan() -> None:
    """Plan the parallelization of a job (not yet available)."""
    typer.echo("parashift plan: not yet available", err=True)
    raise typer.Exit(2)
