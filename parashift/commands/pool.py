"""`parashift submit SPEC --pool POOL.yaml` and `parashift pool POOL.yaml`: jobs into a pool, and
the pool's controller (docs/pool.md)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from parashift.commands.spec import load_or_exit, load_spec_or_exit

if TYPE_CHECKING:
    from parashift.specs.pool import PoolSpec


def load_pool_or_exit(path: Path) -> PoolSpec:
    """The validated pool file, or its `FILE:LINE:COL` errors on stderr and exit status 1."""
    from parashift.specs.pool import load_pool

    return load_or_exit(path, load_pool)


def submit(
    spec_file: Path = typer.Argument(..., help="the job's spec YAML"),
    pool_file: Path = typer.Option(..., "--pool", help="the pool file (pool.yaml) of the pool to run it in"),
) -> None:
    """Queue a job in a pool: its controller starts it when the pool gives it devices, and
    changes its device count as the pool's jobs come and go. A relative storage URL in the spec
    is made absolute here (the job runs wherever the pool's worker runs)."""
    from parashift.pool.placement import misfit
    from parashift.pool.state import submit as put_submission
    from parashift.storage import open_store

    pool = load_pool_or_exit(pool_file)
    spec = load_spec_or_exit(spec_file).with_storage_root(os.getcwd())
    if spec.resources.kind != pool.kind:
        typer.echo(f"{spec_file}: resources.kind: the pool {pool.name} has {pool.kind} devices (got {spec.resources.kind})",
                   err=True)
        raise typer.Exit(1)
    if (spec.resources.min_devices or 1) > pool.devices:
        typer.echo(f"{spec_file}: resources.min_devices: the pool {pool.name} has {pool.devices} devices "
                   f"(got {spec.resources.min_devices})", err=True)
        raise typer.Exit(1)
    why = misfit(spec, pool.nodes, pool.devices_per_node)
    if why is not None:
        typer.echo(f"{spec_file}: {why}", err=True)
        raise typer.Exit(1)
    key = put_submission(open_store(pool.with_storage_root(os.getcwd()).storage), pool.name, spec)
    typer.echo(f"{spec.job_id} submitted to pool {pool.name} ({key})")


def pool(
    pool_file: Path = typer.Argument(..., help="the pool file (pool.yaml)"),
    until_idle: bool = typer.Option(False, "--until-idle", help="end when every job submitted has ended"),
    status: bool = typer.Option(False, "--status", help="show what the pool is doing (from its storage) and exit"),
) -> None:
    """Run the pool's controller (a `pool-controller` flow run) against the Prefect server of
    PREFECT_API_URL: jobs start as runs of its train-job deployment, which a process worker runs.
    With --status: each job's devices, progress and why, read from the pool's storage."""
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    spec = load_pool_or_exit(pool_file).with_storage_root(os.getcwd())
    if status:
        show_status(spec)
        return
    from parashift.tasks.events import api_url

    if api_url() is None:
        typer.echo("parashift pool: PREFECT_API_URL is not set. A pool starts its jobs as deployment runs and tells "
                   "them their devices by events, both through a Prefect server (docs/pool.md).", err=True)
        raise typer.Exit(2)
    from parashift.flows.pool import pool_controller

    result = pool_controller(spec, until_idle=until_idle)
    for job, record in result.items():
        typer.echo(f"{job}: {record['status']}" + (f" ({record['reason']})" if record.get("reason") else ""))


def show_status(spec: PoolSpec) -> None:
    """The pool's line and a row per job, from the state its controller keeps in storage."""
    from rich.console import Console
    from rich.table import Table

    from parashift.pool.state import pool_key, read_state
    from parashift.pool.status import status_line, status_rows
    from parashift.storage import open_store

    store = open_store(spec.storage)
    state = read_state(store, spec.name, spec.devices, spec.nodes, spec.devices_per_node)
    pending = [k for k in store.list(pool_key(spec.name, "submitted")) if k not in set(state.submissions_seen)]
    console = Console(soft_wrap=True)
    console.print(status_line(state, len(pending)), markup=False, highlight=False)
    rows = status_rows(state)
    if rows:
        table = Table(*rows[0].keys())
        for row in rows:
            table.add_row(*row.values())
        console.print(table)
