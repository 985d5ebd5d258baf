"""`parashift status SPEC`: where a job stands, read from its storage alone (no Prefect server,
nothing started): whether a run holds it now, its committed checkpoints and what the newest
holds (plan, devices, data position, loss), a stop asked for, and the command that shows its
metrics. `reshard-plan` says what a move would read; this says where the job is."""

from __future__ import annotations

from pathlib import Path

import typer

from parashift.commands.spec import load_spec_or_exit
from parashift.specs.words import counted


def status(spec_file: Path = typer.Argument(..., help="the job's spec YAML")) -> None:
    """Where the job stands: the run that holds it, its checkpoints, the newest's plan and step."""
    from parashift.commands.run import tensorboard_command
    from parashift.storage import JobLease, JobLeaseHeld, JobPaths, StorageError, job_store

    spec = load_spec_or_exit(spec_file)
    checkpoints = job_store(spec)
    store, paths = checkpoints.store, JobPaths(spec.job_id)
    typer.echo(f"{spec.job_id}: {spec.training.steps:,} steps, stored in {store.url_for(f'jobs/{spec.job_id}')}")
    try:
        JobLease(store, spec.job_id).check_free()
        typer.echo("  run           none holds the job now")
    except JobLeaseHeld as held:
        who = held.record
        typer.echo(f"  run           {who.run_id} on {who.host} (pid {who.pid}) holds it, its lease live for "
                   f"{held.remaining_s:.0f} s more unless renewed")
    manifests, refused = {}, []
    for step in checkpoints.manifest_steps():  # each one read: a manifest that does not verify is said, not used
        try:
            manifests[step] = checkpoints.load_manifest(step)
        except StorageError as error:
            refused.append(f"step {step}: {' '.join(str(error).split())}")
    if not manifests:
        typer.echo("  checkpoints   none committed: a run starts at step 0")
    else:
        newest = manifests[max(manifests)]
        loss = newest.metadata.get("loss")
        typer.echo(f"  checkpoints   {', '.join(map(str, manifests))} (newest: step {newest.step} of "
                   f"{spec.training.steps:,}, {newest.created_at})")
        typer.echo(f"  newest        {_plan_of(newest.plan)} on {counted(newest.world_size, 'device')}, "
                   f"{newest.data_position.get('samples_consumed', 0):,} samples consumed"
                   + (f", loss {loss:.4f}" if isinstance(loss, float) else ""))
    for why in refused:
        typer.echo(f"  refused       {why} (a run skips it)")
    if store.exists(paths.stop()):
        asked = store.get_json(paths.stop())
        typer.echo(f"  stop          asked at {asked.get('requested_at')} ({asked.get('reason')}): a run holding the job "
                   "stops at its next step boundary; one started after it ignores it")
    if spec.metrics.tensorboard and store.list(f"jobs/{spec.job_id}/metrics"):
        metrics = store.url_for(f"jobs/{spec.job_id}/metrics")
        typer.echo(f"  metrics       {tensorboard_command(metrics, spec.storage.storage_options)}")


def _plan_of(recorded: dict) -> str:
    """The plan a manifest records, in words (one written by other tools may record none)."""
    from pydantic import ValidationError

    from parashift.specs.plan import Plan

    try:
        return Plan.model_validate(recorded).describe()
    except ValidationError:
        return "a plan it does not record"
