"""`parashift run SPEC`: train a job against the embedded Prefect API, with a progress bar."""

from __future__ import annotations

import logging
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import typer

from parashift.commands.spec import load_spec_or_exit, preflight_lines
from parashift.specs import JobSpec
from parashift.specs.words import counted


def _prefect_defaults(verbose: bool) -> None:
    """Settings that must be in place before Prefect is imported."""
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # The ephemeral API gives up after 20 s by default, which a busy 2-core machine exceeds (measured).
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    if not verbose:  # the log file has everything (`_log_to_file`); the terminal shows progress and the outcome
        os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "CRITICAL")


def _log_to_file(job: str) -> Path:
    """Every line of the run's log (the flow's, its tasks', the workers' relayed output) into
    `.parashift/logs/` of the working directory: without -v the terminal shows progress and one
    line of outcome, and a failure says where the rest is."""
    import time

    folder = Path(".parashift") / "logs"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{job}-{time.strftime('%Y%m%d-%H%M%S')}.log"
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setLevel(logging.INFO)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger().addHandler(handler)  # Prefect's run loggers propagate to the root's handlers
    return path


def run(
    spec_file: Path = typer.Argument(..., help="job spec YAML"),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="show the flow run's log in the terminal"),
) -> None:
    """Train the job SPEC_FILE describes on its devices; resume from its latest checkpoint.
    SIGTERM or Ctrl-C stops it at the next step boundary with a committed checkpoint (twice:
    at once)."""
    began_at = datetime.now(UTC)  # a stop request from here on is this run's (`parashift stop` while it boots)
    # Before anything imports Prefect (the preflight below does): its settings are read once.
    _prefect_defaults(verbose)
    spec = load_spec_or_exit(spec_file)
    from parashift.commands.embedded_api import start_unless_configured

    # Booting from here, the API overlaps the checks, the imports and the workers' boot (stopped
    # at exit; at once where the job is refused).
    api = start_unless_configured()
    # Seconds, before the flow: storage first (storage whose credentials live in a Prefect block
    # is probed by the flow, which can read the block); where it answers, whether another run
    # holds the job, told before the device check imports torch; then data and devices.
    probe_storage = spec.storage.credentials_block is None
    storage_problems = preflight_lines(spec_file, spec, data=False, devices=False) if probe_storage else []
    if probe_storage and not storage_problems:
        from parashift.tasks.exclusive import running_elsewhere

        held = running_elsewhere(spec)
        if held is not None:
            typer.echo(f"{spec_file}: {held}", err=True)
            raise typer.Exit(1)
    problems = preflight_lines(spec_file, spec, storage=False) + storage_problems  # `validate --check`'s order
    if problems:
        for line in problems:
            typer.echo(line, err=True)
        raise typer.Exit(1)

    from parashift.launcher.job_workers import job_workers

    # The job's worker processes (or the forkserver they fork from) boot while the rest imports
    # and the embedded Prefect API starts: the first step comes seconds sooner.
    with job_workers(spec):
        if api is not None:
            api.use()
        _train(spec, verbose, began_at)


def _train(spec: JobSpec, verbose: bool, began_at: datetime) -> None:
    """The flow run with a progress bar, then its outcome in a few lines."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from parashift.flows.train import train_job
    from parashift.launcher.interrupts import stop_on_signals
    from parashift.tasks import progress as progress_events
    from parashift.trainer.events import StartEvent, StepEvent, WorkerEvent

    log_path = _log_to_file(spec.name)
    console = Console(soft_wrap=True)
    stop_on_signals(lambda name: console.print(f"[bold yellow]{name}[/]: stopping at the next step boundary "
                                               "(again to stop at once)"))
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}"),
        TextColumn("{task.fields[rate]}"),
        TimeElapsedColumn(),
        console=console,
    ) as bar:
        task_id = bar.add_task(f"{spec.name} (starting workers)", total=spec.training.steps, loss="-", rate="")

        def on_event(event: WorkerEvent) -> None:
            if isinstance(event, StartEvent):
                bar.update(task_id, completed=event.step, description=f"{spec.name} on {counted(event.world_size, 'worker')}")
            elif isinstance(event, StepEvent):
                bar.update(task_id, completed=event.step, loss=f"{event.loss:.4f}", rate=f"{event.tokens_per_s:,.0f} tok/s")

        progress_events.add_listener(on_event)
        warnings = RunWarnings()
        logging.getLogger().addHandler(warnings)
        try:
            summary = train_job(spec, began_at)
        except Exception as error:  # noqa: BLE001 - the run log has the trace; the terminal gets the reason
            bar.stop()
            console.print(f"[bold red]failed[/]: {error}")
            console.print(f"  full log: {log_path}" + ("" if verbose else " (or run with -v to see it here)"))
            raise typer.Exit(1) from None
        finally:
            progress_events.remove_listener(on_event)
            logging.getLogger().removeHandler(warnings)

    trained = sum(seg.final_step - seg.start_step for seg in summary.segments)
    if summary.segments and summary.segments[-1].stopped:
        console.print(f"[bold yellow]stopped[/]: {summary.job_id} at step {summary.steps}, checkpoint committed; run again to resume")
    elif trained == 0:
        past = f" (past training.steps, {spec.training.steps})" if summary.steps > spec.training.steps else ""
        console.print(f"[bold green]done[/]: {summary.job_id} was already trained to step {summary.steps}{past}")
    else:
        console.print(f"[bold green]done[/]: {summary.job_id} trained to step {summary.steps} ({trained} steps this run)")
    if summary.final_loss is not None:
        first = f"{summary.first_loss:.4f} -> " if trained and summary.first_loss is not None else ""
        console.print(f"  loss          {first}{summary.final_loss:.4f}")
    if summary.eval_loss is not None:
        console.print(f"  held-out      loss {summary.eval_loss:.4f}, perplexity {summary.eval_perplexity:,.2f} "
                      f"(step {summary.eval_step})")
    if summary.tokens_per_s:
        mfu = f", MFU {summary.mfu:.1%}" if summary.mfu else ""
        console.print(f"  throughput    {summary.tokens_per_s:,.0f} tokens/s (median{mfu})")
    plans = plans_in_order([seg.plan for seg in summary.segments if seg.plan])
    if plans:
        console.print(f"  plan          {plans}")
    if summary.metrics_url:
        console.print(f"  metrics       {tensorboard_command(summary.metrics_url, spec.storage.storage_options)}")
    if summary.wandb_url:  # wandb reads local files: a store elsewhere is copied first
        where = summary.wandb_url.removeprefix("file://")
        console.print(f"  wandb         wandb sync {where}" if where != summary.wandb_url else
                      f"  wandb         copy {summary.wandb_url} here, then `wandb sync` it")
    console.print(f"  checkpoint    {summary.checkpoint_url}")
    if warnings.line() is not None:
        console.print(f"  [yellow]warnings[/]      {warnings.line()}", markup=True, highlight=False)
    console.print(f"  log           {log_path}")


class RunWarnings(logging.Handler):
    """The run's warnings, for its summary: without -v the terminal shows none of the log, and a
    run that fell back from a refused checkpoint (trained 30 steps where 10 were due) ended in
    the same lines as any other."""

    SHOWN = 240  # characters of the first warning

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.startswith(("prefect.flow_runs", "prefect.task_runs", "parashift")):
            self.messages.append(" ".join(record.getMessage().split()))

    def line(self) -> str | None:
        """How many, and the first (the cause; what follows it is often its consequence) that is
        not a worker's traceback: a rank killed mid-step leaves its peers' tracebacks of broken
        collectives in the log before the launcher's line that names it."""
        if not self.messages:
            return None
        tracebacks = [m for m in self.messages if m.startswith("Traceback (most recent call last)")]
        others = [m for m in self.messages if m not in tracebacks]
        first = (others or self.messages)[0]
        shown = first if len(first) <= self.SHOWN else first[: self.SHOWN] + "..."
        if tracebacks and others:
            return (f"{counted(len(self.messages), 'warning')} in the log ({counted(len(tracebacks), 'traceback')} "
                    f"of workers); the first other: {shown}")
        return f"{counted(len(self.messages), 'warning')} in the log; the first: {shown}"


def plans_in_order(plans: list[str]) -> str:
    """The segments' plans as the job went through them, a plan repeated by consecutive segments
    (a failure's relaunch) said once: 2 -> 1 -> 2 devices reads "dp 2 -> dp 1 -> dp 2", not as
    if the job had ended on one."""
    return " -> ".join(plan for i, plan in enumerate(plans) if i == 0 or plans[i - 1] != plan)


def tensorboard_command(url: str, storage_options: dict[str, Any]) -> str:
    """The command that shows a job's metrics. TensorBoard reads s3:// itself (with boto3), from
    the endpoint in S3_ENDPOINT: a store on MinIO or another S3-compatible server needs it said."""
    endpoint = storage_options.get("endpoint_url") or (storage_options.get("client_kwargs") or {}).get("endpoint_url")
    prefix = f"S3_ENDPOINT={endpoint} " if url.startswith("s3://") and endpoint else ""
    return f"{prefix}tensorboard --logdir {url}"
