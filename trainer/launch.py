"""Starting the workers: torchrun as a subprocess, its lines handed to the caller as they come.

Kept free of Prefect so the launcher is testable and usable alone; `tasks/launch` streams the
lines into a flow run's log.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from planner.plan import Plan
from specs import JobSpec
from trainer import metrics
from trainer.mesh import job_plan_refusals


class PlanNotExecutable(ValueError):
    """The trainer cannot run this plan on this model (the reasons are in the message)."""


@dataclass
class LaunchResult:
    returncode: int
    events: list[dict[str, Any]] = field(default_factory=list)

    @property
    def steps(self) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == "step"]

    @property
    def final_step(self) -> int | None:
        ends = [e for e in self.events if e["event"] in ("finished", "stopped")]
        return ends[-1]["step"] if ends else None

    @property
    def stopped(self) -> bool:
        return any(e["event"] == "stopped" for e in self.events)

    @property
    def checkpoints(self) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == "checkpoint"]


def torchrun_command(devices: int, module: str, *args: str) -> list[str]:
    """`torchrun` starting `python -m module args` on `devices` local processes."""
    # --standalone: a private rendezvous on a free local port
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={devices}", "-m", module, *args]


def worker_command(devices: int, spec_file: Path, plan_file: Path, until_step: int | None) -> list[str]:
    command = torchrun_command(devices, "trainer.worker", "--spec", str(spec_file), "--plan", str(plan_file))
    if until_step is not None:
        command += ["--until-step", str(until_step)]
    return command


def measure_comm_model(devices: int, kind: str, devices_per_node: int | None = None) -> dict[str, Any]:
    """Run `trainer.measure_comm` on `devices` workers; the fitted model as a JSON dict."""
    command = torchrun_command(devices, "trainer.measure_comm", "--kind", kind)
    if devices_per_node:
        command += ["--devices-per-node", str(devices_per_node)]
    done = subprocess.run(command, capture_output=True, text=True, env=worker_env(kind), timeout=600)
    events = [e for line in done.stdout.splitlines() if (e := metrics.parse(line)) and e["event"] == "comm_model"]
    if done.returncode != 0 or not events:
        raise RuntimeError(f"measuring collectives failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return events[-1]["comm"]


def worker_env(kind: str) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    if kind == "cpu":
        # Several processes share the cores: one thread each (measured: 2 x 2 threads ran 2.3x slower than 2 x 1).
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


def launch_workers(
    spec: JobSpec,
    plan: Plan,
    on_line: Callable[[str], None] = lambda line: None,
    on_event: Callable[[dict[str, Any]], None] = lambda event: None,
    until_step: int | None = None,
    extra_env: dict[str, str] | None = None,
) -> LaunchResult:
    """Run torchrun with `plan.devices` workers until they exit; every output line goes to
    `on_line`, every worker event also to `on_event`. A plan the trainer cannot execute is
    refused here, before any process starts."""
    refusals = job_plan_refusals(plan, spec)
    if refusals:
        raise PlanNotExecutable(f"plan {plan.mesh} cannot run on {spec.job_id}: " + "; ".join(refusals))
    result = LaunchResult(returncode=-1)
    with tempfile.TemporaryDirectory(prefix="parashift-launch-") as tmp:
        spec_file, plan_file = Path(tmp, "spec.json"), Path(tmp, "plan.json")
        spec_file.write_text(spec.model_dump_json())
        plan_file.write_text(plan.model_dump_json())
        process = subprocess.Popen(
            worker_command(plan.devices, spec_file, plan_file, until_step),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            env={**worker_env(spec.resources.kind), **(extra_env or {})},
        )
        assert process.stdout is not None
        try:
            for raw in process.stdout:
                line = raw.rstrip("\n")
                on_line(line)
                event = metrics.parse(line)
                if event is not None:
                    result.events.append(event)
                    on_event(event)
        finally:
            result.returncode = process.wait()
    return result
