"""`parashift plan`: search the parallelization of a job and print it against the baselines."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from parashift.specs.words import counted

if TYPE_CHECKING:
    from parashift.planner.profile import DeviceModel, ModelProfile
    from parashift.specs.models import ParallelismSpec
    from parashift.specs.plan import Plan

MAX_DEVICES = 65536


def _label(splits: dict[str, tuple[str, ...]]) -> str:
    return " ".join(f"{dim}/{'x'.join(axes)}" for dim, axes in splits.items()) or "replicated"


def _device_count(text: str | None) -> int | None:
    """`--devices` as a whole number from 1 to MAX_DEVICES, else one line and exit 2 (a usage
    error). Parsed here, not by typer: its range and type checks print a six-line box."""
    if text is None:
        return None
    try:
        n = int(text)
    except ValueError:
        n = 0
    if not 1 <= n <= MAX_DEVICES:
        typer.echo(f"parashift plan: --devices must be a whole number from 1 to {MAX_DEVICES} (got {text!r})",
                   err=True)
        raise typer.Exit(2)
    return n


def _one_line(error: BaseException) -> str:
    """An exception as one line: its message (named by its type unless a ValueError, which the
    search raises to explain itself), whitespace collapsed."""
    text = " ".join(str(error).split())
    if isinstance(error, ValueError):
        return text
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _refuse_oversized_exhaustive(profile: ModelProfile, label: str) -> None:
    """Brute force holds one array axis per op: a larger graph is refused before any search,
    with the limit and the way that plans it (the DP, the default)."""
    from parashift.planner.dp import BRUTE_FORCE_MAX_OPS

    ops = len(profile.graph.ops)
    if ops > BRUTE_FORCE_MAX_OPS:
        typer.echo(f"{label}: --exhaustive enumerates graphs of at most {BRUTE_FORCE_MAX_OPS} ops and this one has "
                   f"{ops}; plan it without --exhaustive (the DP, the default)", err=True)
        raise typer.Exit(1)


def _solve(search: Callable[..., Plan], profile: ModelProfile, n: int, par: ParallelismSpec, label: str,
           exhaustive: bool, ac_modes: tuple[str, ...] | None = None) -> Plan:
    """The search's Plan; any failure of it one line and exit 1, never a traceback: a ValueError
    it raises to explain itself, a MemoryError on a graph too wide, or a bug."""
    try:
        limit = par.plan_memory_bytes(profile.device.memory_bytes)  # the device less the reserve for transients
        return search(profile, n, limit, par.max_tp, par.max_pp, shard_dp=par.shard_data_parallel,
                      ac_modes=ac_modes or par.ac_searched(), mixed_precision=par.mixed_precision)
    except Exception as error:
        typer.echo(f"{label}: cannot plan it{' exhaustively' if exhaustive else ''}: {_one_line(error)}", err=True)
        raise typer.Exit(1) from None


def plan(
    spec: Path = typer.Argument(..., help="job spec YAML (its model, batch, resources and limits)"),
    devices: str | None = typer.Option(None, "--devices", "-n", metavar="INTEGER",
                                       help=f"devices to plan for, 1 to {MAX_DEVICES} (default: the spec's)"),
    json_out: bool = typer.Option(False, "--json", help="print the Plan as JSON only"),
    exhaustive: bool = typer.Option(False, "--exhaustive", help="enumerate every assignment of each stage instead of the DP (small graphs)"),
    graph: Path | None = typer.Option(None, "--graph", help="plan this JSON op graph instead of the spec's model"),
    measure: bool = typer.Option(False, "--measure", help="time GEMMs on this machine for compute rates"),
) -> None:
    """Plan the parallelization of a job: per-op placements, step time, memory, baselines."""
    from parashift.commands.spec import load_spec_or_exit
    from parashift.models import ModelUnbuildable, family_of
    from parashift.planner.graph import GraphError, load_graph_json
    from parashift.planner.profile import measurable_here, profile_graph
    from parashift.planner.search import exhaustive_search, plan_model

    count = _device_count(devices)
    job = load_spec_or_exit(spec)
    res, model, par = job.resources, job.model, job.parallelism
    n = count or res.devices
    kind = getattr(res, "kind", "cpu")
    if measure and not measurable_here(kind):
        typer.echo(f"{spec}: --measure times this machine's {kind} devices, and it has none; plan without it "
                   "(the cuda default: an H200) and set resources.memory_gb, or run it where the job's GPUs are",
                   err=True)
        raise typer.Exit(1)
    if graph is not None:
        try:
            op_graph = load_graph_json(graph)
        except GraphError as error:
            for line in error.problems:
                typer.echo(line, err=True)
            raise typer.Exit(1) from None
        profile = profile_graph(op_graph, kind, measure, memory_gb=res.memory_gb, devices_per_node=res.devices_per_node)
    elif family_of(model).graph_builder is None:  # no op graph: the data axis's options, measured here
        from parashift.planner.measured import plan_measured, profile_from_measurements
        from parashift.trainer.measure_model import measure_for_gpus, measure_model

        train = job.training
        modes = par.ac_searched()
        try:
            numbers = (measure_model(model, train.micro_batch, par.precision, modes=modes) if kind == "cpu"
                       else measure_for_gpus(model, par.precision, modes=modes))
        except ModelUnbuildable as error:  # a field only building the model checks: one line, as preflight's
            typer.echo(f"{spec}: {error}", err=True)
            raise typer.Exit(1) from None
        measured = profile_from_measurements(model.tag, numbers, kind,
                                             res.devices_per_node or n, res.memory_gb, None, res.devices_per_node,
                                             seq_len=model.seq_len)
        result = plan_measured(measured, n, train.global_batch, train.micro_batch,
                               par.plan_memory_bytes(measured.device.memory_bytes), shard_dp=par.shard_data_parallel,
                               ac_modes=modes, mixed_precision=par.bf16_policy())
        checkpointing = (f", {result.activation_checkpointing} activation checkpointing"
                         if result.activation_checkpointing != "none" else "")
        typer.echo(result.model_dump_json(indent=2) if json_out else "\n".join(
            [f"{model.tag} on {counted(n, kind + ' device')}: dp {n}, "
             + (f"state sharded over {result.dp_shard}" if result.dp_shard > 1 else "state replicated")
             + f"{checkpointing} ({result.estimated_step_s or 0:.4g} s per step, "
               f"{(result.memory_per_device_bytes or 0) / 2**30:.2f} GiB per device)", *result.notes]))
        return
    else:
        batch = job.training.global_batch
        profile = profile_graph(family_of(model).graph(model, batch, par.precision), kind, measure,
                                memory_gb=res.memory_gb, devices_per_node=res.devices_per_node,
                                tokens=batch * model.seq_len)
    label = str(graph or spec)
    if exhaustive:
        _refuse_oversized_exhaustive(profile, label)
    result = _solve(exhaustive_search if exhaustive else plan_model, profile, n, par, label, exhaustive)
    if json_out:
        typer.echo(result.model_dump_json(indent=2))
        return

    from rich.console import Console
    from rich.table import Table

    sharded = f", dp sharded over {result.dp_shard}" if result.dp_shard > 1 else ""
    batches = f"{result.micro_batches} micro-batch{'es' if result.micro_batches != 1 else ''}"
    table = Table(title=f"{profile.name} on {counted(n, kind + ' device')}: mesh {result.mesh}{sharded}, {batches}")
    for col in ("op", "stage", "configuration", "compute ms", "comm ms", "memory MB"):
        table.add_column(col, justify="left" if col in ("op", "configuration") else "right")
    for p in result.placements:
        table.add_row(p.op, str(p.stage), _label(p.splits), f"{p.compute_s * 1e3:.3f}", f"{p.comm_s * 1e3:.3f}",
                      f"{p.memory_bytes / 2**20:.1f}")
    console = Console(soft_wrap=True)  # a line per fact, however narrow the terminal (or a pipe's 80 columns)
    console.print(table)
    console.print(_device_line(profile.device, kind, measure, res.memory_gb, par.plan_memory_bytes(profile.device.memory_bytes)))
    step = result.estimated_step_s or 0.0
    console.print(f"estimated step: {step:.4g} s ({result.strategy}), "
                  f"memory {result.memory_per_device_bytes / 2**30:.2f} GiB per device"
                  + ("" if result.feasible else " [red](over the limit)[/red]"))
    chosen = (", ".join(f"stage {s} {mode}" for s, mode in enumerate(result.stage_activation_checkpointing))
              if result.stage_activation_checkpointing else result.activation_checkpointing)
    console.print(f"  activation checkpointing: {chosen}; bf16 by {_bf16_by(par.mixed_precision, result)}"
                  if par.precision == "bf16" else f"  activation checkpointing: {chosen}")
    other = "none" if result.activation_checkpointing != "none" else "selective"
    alternative = _solve(exhaustive_search if exhaustive else plan_model, profile, n, par, label, exhaustive, (other,))
    instead = "without activation checkpointing" if other == "none" else f"with {other} activation checkpointing"
    console.print(f"  {instead} instead: mesh {alternative.mesh}, {alternative.estimated_step_s or 0:.4g} s, "
                  f"{(alternative.memory_per_device_bytes or 0) / 2**30:.2f} GiB per device"
                  + ("" if alternative.feasible else " (over the limit)"))
    if result.proven_optimal:
        console.print("  proven optimal under the cost model (no fitting plan is faster)")
    elif result.lower_bound_s is not None:
        console.print(f"  not proven optimal: every fitting plan takes at least {result.lower_bound_s:.4g} s")
    for name, t in result.baselines.items():
        mem = result.baseline_memory_bytes.get(name, 0) / 2**30
        console.print(f"  {name:>14}: {t:.4g} s ({t / step if step else float('nan'):.2f}x), {mem:.2f} GiB per device")
    if par.strategy == "pinned" and graph is None:
        console.print(_pinned_line(job, profile, n, step))
    for note in result.notes:
        console.print(f"  note: {note}")


def _bf16_by(asked: str, plan: Plan) -> str:
    """How the plan gets its bf16 compute: as asked, except that FSDP2's policy needs a data axis."""
    from parashift.planner.checkpointing import policy_on

    policy = policy_on(asked, plan.degree("dp"))
    return policy if policy == asked else f"{policy} (FSDP2's policy needs a data axis, and this plan has none)"


def _device_line(device: DeviceModel, kind: str, measured: bool, memory_gb: float | None, limit: int | None) -> str:
    """What the plan assumed of each device, and where that came from: planned on a head node
    without the job's GPUs, a plan for the default device (an H200's memory) reads as one for
    the cluster's, and an H100 job's plan could need more memory than its devices have."""
    if measured:
        source = "measured here"
    elif kind == "cuda":
        source = "the cuda default: an H200; --measure on the job's GPU, or resources.memory_gb"
    else:
        source = "the cpu default; --measure times this machine"
    if memory_gb is not None:
        source += "; memory from resources.memory_gb"
    memory = ("memory unlimited" if device.memory_bytes is None or limit is None else
              f"{device.memory_bytes / 2**30:.1f} GiB, {limit / 2**30:.1f} GiB planned (less the reserve)")
    return f"device: {device.matmul_flops / 1e12:.4g} TFLOP/s GEMM, {memory} ({source})"


def _pinned_line(job: object, profile: ModelProfile, n: int, searched_s: float) -> str:
    """The spec's pinned plan on `n` devices beside the planner's pick: its estimate, or why it
    cannot run there (the job then runs the planner's pick)."""
    from parashift.models.plans import pinned_plan_for
    from parashift.planner.pinned import estimate

    plan, refused = pinned_plan_for(job, n)  # type: ignore[arg-type]
    if plan is None:
        return f"  pinned: {refused}; the job runs the planner's pick"
    par = job.parallelism  # type: ignore[attr-defined]
    try:
        got = estimate(profile, plan, par.mixed_precision if par.precision == "bf16" else None)
    except ValueError as error:
        return f"  pinned: mesh {plan.mesh} (what the job runs); no estimate: {error}"
    ratio = got.time_s / searched_s if searched_s else float("nan")
    return (f"  pinned: mesh {plan.mesh} (what the job runs): {got.time_s:.4g} s ({ratio:.2f}x the pick), "
            f"{got.memory_bytes / 2**30:.2f} GiB per device")
