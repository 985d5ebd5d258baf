"""`parashift export SPEC --format hf --to DIR`: a committed checkpoint as a Hugging Face
checkpoint folder (config.json + size-sharded *.safetensors)."""

from __future__ import annotations

from pathlib import Path

import typer


def export(
    spec_file: Path = typer.Argument(..., help="the job's spec YAML"),
    to: str = typer.Option(..., "--to", help="the folder (or fsspec URL) to write"),
    format: str = typer.Option("hf", "--format", help="hf: a Hugging Face checkpoint (the only format)"),
    step: int | None = typer.Option(None, "--step", help="a committed step (default: the newest)"),
    max_shard_gb: float = typer.Option(5.0, "--max-shard-gb", min=0.0, help="largest *.safetensors file"),
    dtype: str = typer.Option("float32", "--dtype", help="the weights' dtype: float32 (as trained and stored), "
                                                         "bfloat16 or float16 (half the size)"),
) -> None:
    """Write a committed checkpoint of the job as a Hugging Face checkpoint, one shard at a
    time, every byte read verified against its checksum."""
    from parashift.commands.spec import load_spec_or_exit

    if format != "hf":
        typer.echo(f"unknown format {format!r}: the only one is hf", err=True)
        raise typer.Exit(1)
    spec = load_spec_or_exit(spec_file)
    from parashift.storage import CheckpointNotFound, StorageError, job_store
    from parashift.trainer.export import export_hf

    try:
        report = export_hf(spec, to, step, max_shard_bytes=max(1, int(max_shard_gb * 1e9)), dtype=dtype)
    except (ValueError, FileNotFoundError, KeyError, StorageError) as error:
        there = ""
        if isinstance(error, CheckpointNotFound) and step is not None:  # which steps may be asked for
            steps = job_store(spec).committed_steps()
            there = f"; its committed steps: {', '.join(map(str, steps))}" if steps else "; it has no committed step"
        typer.echo(f"{spec_file}: cannot export: {error}{there}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"exported step {report.step} of {spec.job_id}: {report.tensors} tensors, "
               f"{report.bytes_written / 1e6:.1f} MB in {len(report.files)} files to {report.url}")
    for name, origin in report.copied.items():
        typer.echo(f"  {name} from {origin}")
