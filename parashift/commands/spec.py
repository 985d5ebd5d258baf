"""`parashift validate` and `parashift schema`."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import typer

if TYPE_CHECKING:
    from parashift.specs import JobSpec

Loaded = TypeVar("Loaded")


def load_or_exit(path: Path, load: Callable[[Path], Loaded]) -> Loaded:
    """What `load` reads from a spec-language file (a job spec, a pool file), or its
    `FILE:LINE:COL` errors on stderr and exit status 1."""
    from parashift.specs import SpecError

    try:
        return load(path)
    except SpecError as error:
        for line in error.lines():
            typer.echo(line, err=True)
        raise typer.Exit(1) from None


def load_spec_or_exit(spec_file: Path) -> JobSpec:
    """The validated spec, or its `FILE:LINE:COL` errors on stderr and exit status 1."""
    from parashift.specs import load_spec

    return load_or_exit(spec_file, load_spec)


def preflight_lines(spec_file: Path, spec: JobSpec, *, storage: bool = True, data: bool = True,
                    devices: bool = True) -> list[str]:
    """`FILE: field: message` for each reason the job cannot run on this machine (storage,
    data, devices; each unless turned off), checked in seconds; [] when it can."""
    from parashift.tasks.preflight import preflight

    return [f"{spec_file}: {problem}" for problem in preflight(spec, storage=storage, data=data, devices=devices)]


def validate(
    files: list[Path] = typer.Argument(..., help="job spec YAML files"),
    check: bool = typer.Option(False, "--check", help="also check storage, data and devices from this machine"),
) -> None:
    """Check job specs; print one `FILE:LINE:COL: field.path: message` line per error."""
    from parashift.specs import SpecError, load_spec

    failed = False
    for file in files:
        try:
            spec = load_spec(file)
        except SpecError as error:
            failed = True
            for line in error.lines():
                typer.echo(line, err=False)
            continue
        problems = preflight_lines(file, spec) if check else []
        for line in problems:
            typer.echo(line)
        failed |= bool(problems)
        if not problems:
            typer.echo(f"{file}: ok")
    raise typer.Exit(1 if failed else 0)


def schema() -> None:
    """Print the JSON Schema of a job spec."""
    from parashift.specs import json_schema

    typer.echo(json.dumps(json_schema(), indent=2))


def held_by_a_run(spec: JobSpec) -> bool:
    """Whether a run holds the job's storage lease now: what `stop` and `scale` tell their user."""
    from parashift.storage import JobLease, JobLeaseHeld, open_store

    try:
        JobLease(open_store(spec.storage), spec.job_id).check_free()
    except JobLeaseHeld:
        return True
    return False
