"""`parashift scale JOB --devices N` (or `--nodes a,b`): tell a running job its devices changed."""

from __future__ import annotations

import os
from pathlib import Path

import typer

from parashift.commands.spec import held_by_a_run, load_spec_or_exit


def scale(
    job: str = typer.Argument(..., help="the job's spec YAML, or its name"),
    devices: int | None = typer.Option(None, "--devices", "-n", min=1, help="devices the job should run on from now"),
    nodes: str | None = typer.Option(None, "--nodes", help="a job across nodes: the nodes it should run on, "
                                                           "comma-separated (each with the spec's devices per node)"),
    epoch: int | None = typer.Option(None, min=0, help="ordering of changes (default: now, in ms since 1970)"),
    reason: str = typer.Option("scale", help="recorded with the change: scale, scale-up, scale-down, manual, "
                                             "preemption, ... (specs.models.Reason)"),
) -> None:
    """Emit a `parashift.resources.changed` event for JOB. A running job stops at its next step
    boundary, re-plans for the new devices (or nodes), reshards its checkpoint and continues.
    Needs the Prefect server the job runs against (PREFECT_API_URL). Given a spec file, a change
    the job would ignore (docs/elastic.md) is refused here."""
    from parashift.specs.elastic import REASONS, check_change

    if (devices is None) == (nodes is None):
        typer.echo("parashift scale: give --devices or --nodes (one of them)", err=True)
        raise typer.Exit(2)
    if reason not in REASONS:
        typer.echo(f"parashift scale: --reason must be one of {', '.join(REASONS)} (got {reason!r})", err=True)
        raise typer.Exit(2)
    node_list = [n.strip() for n in nodes.split(",") if n.strip()] if nodes is not None else None
    spec = load_spec_or_exit(Path(job)) if job.endswith((".yaml", ".yml")) or Path(job).is_file() else None
    job_id = spec.job_id if spec is not None else job
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from parashift.tasks.events import (
        EVENT,
        ResourceEvent,
        api_url,
        emit_resource_change,
        now_epoch,
        resource_id,
    )

    if api_url() is None:
        typer.echo("parashift scale: PREFECT_API_URL is not set. Resource events travel through a Prefect server; "
                   "a job run by `parashift run` on the embedded API cannot hear them (stop it with "
                   "`parashift stop` and run it again with other devices).", err=True)
        raise typer.Exit(2)
    change = ResourceEvent(devices=devices, nodes=node_list, epoch=now_epoch() if epoch is None else epoch,
                           reason=reason)  # type: ignore[arg-type]  # one of REASONS, checked above
    if spec is not None:
        try:
            check_change(change, spec)
        except ValueError as error:
            typer.echo(f"parashift scale: {spec.job_id} would ignore {change.describe()}: {error}", err=True)
            raise typer.Exit(2) from None
    emit_resource_change(job_id, change)
    typer.echo(f"{EVENT} {resource_id(job_id)}: {change.describe()} epoch={change.epoch} reason={change.reason}")
    if spec is not None and not held_by_a_run(spec):
        typer.echo(f"no run of {job_id} holds its lease now: none hears this change (events reach running jobs "
                   "only); a run started later starts on its spec's resources")

