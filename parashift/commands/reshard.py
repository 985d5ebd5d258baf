"""`parashift reshard-plan SPEC`: what moving the job's newest checkpoint onto a plan would
read, rank by rank, before anything starts."""

from __future__ import annotations

import json
from pathlib import Path

import typer


def _mesh(text: str) -> dict[str, int]:
    """"dp=2,tp=2" -> {"dp": 2, "tp": 2}."""
    try:
        return {axis.strip(): int(size) for axis, size in (part.split("=") for part in text.split(",") if part.strip())}
    except ValueError:
        raise typer.BadParameter(f"expected AXIS=SIZE[,AXIS=SIZE...] with axes pp, dp, tp; got {text!r}") from None


def reshard_plan(
    spec_file: Path = typer.Argument(..., help="the job's spec YAML"),
    plan_file: Path | None = typer.Option(None, "--plan", help="a Plan JSON (as `parashift plan --json` prints)"),
    mesh: str | None = typer.Option(None, "--mesh", help="a mesh instead, e.g. dp=2,tp=2 (Megatron-style tp)"),
    devices: int | None = typer.Option(None, "--devices", "-n", help="data parallel on this many devices"),
    json_out: bool = typer.Option(False, "--json", help="print per-rank totals as JSON"),
) -> None:
    """Show the reconfiguration plan from the newest committed checkpoint to a plan: bytes each
    new rank needs and reads, its ranged requests, and what this node's tier serves."""
    from parashift.commands.spec import load_spec_or_exit
    from parashift.models.plans import job_plan_refusals
    from parashift.specs.plan import Plan
    from parashift.tasks.reshard import job_reshard_plan

    spec = load_spec_or_exit(spec_file)
    if plan_file is not None:
        plan = Plan.model_validate_json(plan_file.read_text())
    elif mesh is not None:
        sizes = _mesh(mesh)
        total = 1
        for n in sizes.values():
            total *= n
        plan = Plan(devices=total, mesh=sizes, strategy="given")
    else:
        plan = Plan.data_parallel(devices or spec.resources.devices)
    refusals = job_plan_refusals(plan, spec)
    if refusals:
        typer.echo(f"the trainer cannot run mesh {plan.mesh} on this job: " + "; ".join(refusals), err=True)
        raise typer.Exit(1)
    reconfig = job_reshard_plan(spec, plan)
    if reconfig is None:
        typer.echo(f"{spec.job_id} has no committed checkpoint: nothing to move")
        return
    if json_out:
        typer.echo(json.dumps({"step": reconfig.step, "mesh": plan.mesh, "totals": reconfig.totals(),
                               "ranks": reconfig.summary()}))
        return

    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{spec.job_id}: checkpoint at step {reconfig.step} onto mesh {plan.mesh or {'dp': 1}}")
    for column in ("rank", "needs MB", "reads MB", "requests", "from node tier MB"):
        table.add_column(column, justify="right")
    for row in reconfig.summary():
        table.add_row(str(row["rank"]), f"{row['bytes_needed'] / 1e6:.2f}", f"{row['bytes_read'] / 1e6:.2f}",
                      str(row["requests"]), f"{row['bytes_local'] / 1e6:.2f}")
    totals = reconfig.totals()
    console = Console(soft_wrap=True)  # the totals on one line at any width
    console.print(table)
    ratio = totals["bytes_read"] / totals["bytes_needed"] if totals["bytes_needed"] else 1.0
    console.print(f"total: reads {totals['bytes_read'] / 1e6:.2f} MB for {totals['bytes_needed'] / 1e6:.2f} MB needed "
                  f"({ratio:.4f}x) in {totals['requests']} requests; {totals['bytes_local'] / 1e6:.2f} MB from this node")
