"""The `parashift` command. Each subcommand lives in `parashift/commands/` and imports its
engine lazily, so `parashift validate` answers without paying for torch or Prefect imports."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import typer

from parashift.commands import data as data_commands
from parashift.commands import export as export_command
from parashift.commands import plan as plan_command
from parashift.commands import pool as pool_commands
from parashift.commands import reshard as reshard_command
from parashift.commands import run as run_command
from parashift.commands import scale as scale_command
from parashift.commands import serve as serve_command
from parashift.commands import spec as spec_commands
from parashift.commands import status as status_command
from parashift.commands import stop as stop_command

app = typer.Typer(
    name="parashift",
    help="Train PyTorch models whose parallelism changes while they run.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.command("validate")(spec_commands.validate)
app.command("schema")(spec_commands.schema)
app.command("plan")(plan_command.plan)
app.command("run")(run_command.run)
app.command("reshard-plan")(reshard_command.reshard_plan)
app.command("status")(status_command.status)
app.command("stop")(stop_command.stop)
app.command("scale")(scale_command.scale)
app.command("serve")(serve_command.serve)
app.command("export")(export_command.export)
app.command("submit")(pool_commands.submit)
app.command("pool")(pool_commands.pool)
app.command("prepare-data")(data_commands.prepare_data)
app.add_typer(data_commands.tokenizer_app, name="tokenizer")


def first_sentence(command: Callable[..., Any]) -> str:
    """A command's first sentence on one line, for the listings of `parashift --help` (Typer
    would show its docstring's first paragraph with the line breaks, cut across lines)."""
    text = " ".join((command.__doc__ or "").split())
    return text.split(". ", 1)[0].rstrip(".") + "."


for typer_app in (app, data_commands.tokenizer_app):
    for registered in typer_app.registered_commands:
        if registered.callback is not None and registered.short_help is None:
            registered.short_help = first_sentence(registered.callback)


if __name__ == "__main__":
    app()
