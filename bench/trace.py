"""Goodput over a resource trace: the training time a job loses to device changes, for each way
of reacting to them, in the same run.

The trace (default: 4 devices; at step 6 down to 2; at step 12 up to 4; at step 16 one worker
is killed, so 3; the job ends at step 24) is replayed on CPU workers with a GPT of ~293 MB of
state (bench.rescale_latency's), for:

- `parashift`: the `train-job` flow against a real Prefect server (started here) with
  `resources.warm_workers` (launcher/warm_launch.py): planned changes sent as resource events
  when the trace's step is reported, the failure a SIGKILL of rank 1; each change stops the
  workers at a step boundary, re-plans, and the same processes (plus or minus some) resume
  from the committed checkpoint, resharded out of the live workers' memory (their own, or a
  peer's over the gloo group; storage for what no live rank holds);
- `relaunch`: the same flow with the warm path off: a fresh torchrun for every segment;
- `stop_restart`: what a torchtitan user does (bench/dcp_restart.py): torchrun on the count,
  FSDP2, a DCP checkpoint every `--checkpoint-every` steps and at each planned stop, restarted
  on the new count with DCP's reshard-on-load;

Per system: `wall_s` (first step started -> last step done), `downtimes_s` (one per change:
the last step done under the old layout -> the first step done under the new one, as rank 0
reported them; `median_planned_downtime_s` over the announced changes alone, the failure left
out), `retrained_steps`, and `goodput`: the time a static run on the same devices over time
would need / `wall_s`. That time is each kept step at the median step time of its device count
(measured in this run) plus what a static run spends beyond its median steps: its first steps
in fresh processes and its checkpoints' share of the steps they overlap (`static_excess_s`:
a static run on 4 workers of the same job, measured the same way in every round, before the
systems; the median over rounds). `goodput_median_steps` leaves that out (the bench's measure
before 2026-12-04).
`losses_equal_static`: parashift's every step within 1e-5 of the static run (both parashift
systems). Last line: one JSON object.

    OMP_NUM_THREADS=1 python -m bench.trace [--rounds 3] [--steps 24]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from parashift.bench.prefect_server import bench_prefect_server
from parashift.bench.rescale_latency import MODEL

# (at step, devices after, reason); devices None: rank 1 is killed (the job goes on with one fewer)
TRACE: list[tuple[int, int | None, str]] = [(6, 2, "scale-down"), (12, 4, "scale-up"), (16, None, "failure")]
START_DEVICES = 4
CHECKPOINT_EVERY = 6


def job_spec(name: str, store: Path, steps: int, warm: bool = False) -> Any:
    from parashift.specs import JobSpec

    return JobSpec.model_validate({
        "name": name,
        "model": MODEL,
        "data": {"url": "builtin://python-stdlib", "max_bytes": 200_000},
        "training": {"global_batch": 12, "micro_batch": 3, "steps": steps, "checkpoint_every": CHECKPOINT_EVERY,
                     "log_every": 1},
        "resources": {"devices": START_DEVICES, "kind": "cpu", "warm_workers": warm},
        "storage": {"url": f"file://{store}"},
    })


class Timeline:
    """Rank 0's step events as the bench heard them: (time, segment, step, step_s, loss)."""

    def __init__(self) -> None:
        self.steps: list[tuple[float, int, int, float, float]] = []
        self.data_waits: dict[tuple[int, int], float] = {}  # (segment, step) -> the step's wait for its batch
        self.devices: list[int] = []  # per segment
        self.started: list[tuple[float, dict[str, float | None]]] = []  # per segment: when heard, its start phases
        self.ended: list[float] = []  # when each segment's workers reported stopping (a planned change)

    def start(self, world_size: int, phases: dict[str, float | None] | None = None) -> None:
        self.devices.append(world_size)
        self.started.append((time.time(), dict(phases or {})))

    def stop(self) -> None:
        self.ended.append(time.time())

    def breakdown(self) -> list[dict[str, float]]:
        """Per change: the old workers' stop after their last step (planned changes), the flow's
        and the launcher's time until the new workers start, their start-up phases (process
        group, data, model build, layout, restore), and the first step itself."""
        out = []
        for seg in range(1, len(self.devices)):
            last_old = max(t for t, s, *_ in self.steps if s == seg - 1)
            heard, phases = self.started[seg]
            startup = sum(v for k, v in phases.items() if v is not None and k != "boot_s")
            first_new = min((t, st_s) for t, s, _, st_s, _ in self.steps if s == seg)
            stopped = next((t for t in self.ended if last_old <= t <= heard), None)
            out.append({
                "stop_s": round(stopped - last_old, 3) if stopped is not None else None,
                "between_s": round(heard - startup - (stopped if stopped is not None else last_old), 3),
                "startup_s": round(startup, 3),
                **{k: v for k, v in phases.items() if v is not None},
                "first_step_s": round(first_new[1], 3),
                "first_step_data_wait_s": round(self.data_waits.get((seg, self._first_step(seg)), 0.0), 3),
                "rest_s": round(first_new[0] - heard - first_new[1], 3),
            })
        return out

    def _first_step(self, seg: int) -> int:
        return min(st for _, s, st, *_ in self.steps if s == seg)

    def step(self, step: int, step_s: float, loss: float, data_wait_s: float = 0.0) -> None:
        self.steps.append((time.time(), len(self.devices) - 1, step, step_s, loss))
        self.data_waits[(len(self.devices) - 1, step)] = data_wait_s

    def excess_s(self) -> float:
        """A run of one segment: its wall time beyond its steps at their median (its first steps,
        the checkpoints' share of the steps they overlap, gaps between steps)."""
        times = [st_s for *_, st_s, _ in self.steps]
        first = self.steps[0]
        return self.steps[-1][0] - (first[0] - first[3]) - len(times) * statistics.median(times)

    def figures(self, total_steps: int) -> dict[str, Any]:
        segments = sorted({s for _, s, *_ in self.steps})
        downtimes, retrained = [], 0
        for seg in segments[1:]:
            last_old = max(t for t, s, *_ in self.steps if s == seg - 1)
            first_new = min(t for t, s, *_ in self.steps if s == seg)
            downtimes.append(first_new - last_old)
            old_last = max(st for _, s, st, *_ in self.steps if s == seg - 1)
            new_first = min(st for _, s, st, *_ in self.steps if s == seg)
            retrained += max(0, old_last - new_first + 1)
        # the step time of each device count: median over its segments' steps, each segment's first left out
        by_count: dict[int, list[float]] = {}
        for seg in segments:
            times = [st_s for _, s, _, st_s, _ in self.steps if s == seg][1:]
            by_count.setdefault(self.devices[seg], []).extend(times)
        step_s = {count: statistics.median(times) for count, times in by_count.items() if times}
        kept: dict[int, int] = {}  # step -> segment that trained it last
        for _, seg, st, _, _ in self.steps:
            kept[st] = seg
        ideal = sum(step_s[self.devices[seg]] for seg in kept.values())  # every kept step at its count's median
        first = self.steps[0]
        wall = self.steps[-1][0] - (first[0] - first[3])
        start = first[0] - first[3]
        return {"wall_s": round(wall, 3), "downtimes_s": [round(d, 3) for d in downtimes], "retrained_steps": retrained,
                "ideal_s": round(ideal, 3), "goodput_median_steps": round(ideal / wall, 4),
                "step_s_by_devices": {k: round(v, 4) for k, v in step_s.items()},
                "steps": len(kept) == total_steps,
                # (segment, step, its step_s, done at s from the start): where a trace's time went, step by step
                "timeline": [(seg, st, round(st_s, 3), round(t - start, 3)) for t, seg, st, st_s, _ in self.steps]}


def relaunch_round(store: Path, steps: int, round_no: int, warm: bool = False) -> tuple[dict[str, Any], dict[int, float]]:
    from parashift.flows.train import train_job
    from parashift.tasks import progress
    from parashift.tasks.events import ResourceEvent, emit_resource_change, now_epoch
    from parashift.trainer.events import StartEvent, StepEvent, StoppedEvent, WorkerEvent

    spec = job_spec(f"trace-{'warm' if warm else 'relaunch'}-{round_no}", store, steps, warm)
    timeline, pids, done = Timeline(), [], set()
    losses: dict[int, float] = {}

    def listen(event: WorkerEvent) -> None:
        if isinstance(event, StartEvent):
            timeline.start(event.world_size, event.phases)
            pids[:] = event.pids
        if isinstance(event, StoppedEvent):
            timeline.stop()
        if not isinstance(event, StepEvent):
            return
        timeline.step(event.step, event.step_s, event.loss, event.data_wait_s or 0.0)
        losses[event.step] = event.loss
        for at, devices, _ in TRACE:
            if event.step == at and at not in done:
                done.add(at)
                if devices is None:
                    os.kill(pids[1], signal.SIGKILL)
                else:
                    threading.Thread(target=emit_resource_change,
                                     args=(spec.job_id, ResourceEvent(devices=devices, epoch=now_epoch()))).start()

    progress.add_listener(listen)
    try:
        summary = train_job(spec)
    finally:
        progress.remove_listener(listen)
    figures = timeline.figures(steps)
    figures["segments"] = [(s.devices, s.start_step, s.final_step, s.outcome) for s in summary.segments]
    figures["breakdown"] = timeline.breakdown()
    return figures, losses


def stop_restart_round(store: Path, steps: int, round_no: int) -> dict[str, Any]:
    from parashift.launcher.launch import torchrun_command, worker_env
    from parashift.trainer.events import StartEvent, StepEvent, parse

    spec = job_spec(f"trace-dcp-{round_no}", store, steps)
    spec_file = store / "spec.json"
    store.mkdir(parents=True, exist_ok=True)
    spec_file.write_text(spec.model_dump_json())
    timeline, devices, position = Timeline(), START_DEVICES, 0
    plan = [*TRACE, (steps, 0, "end")]
    for at, after, _ in plan:
        kill_at = at if after is None else None
        until = steps if after is None else at  # a failure is not announced: the job runs on until killed
        command = torchrun_command(devices, "parashift.bench.dcp_restart", "--spec", str(spec_file), "--ckpt", str(store / "dcp"),
                                   "--until-step", str(until), "--checkpoint-every", str(CHECKPOINT_EVERY),
                                   log_dir=store / "torchrun")
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                   env=worker_env("cpu"), start_new_session=True)
        assert process.stdout is not None
        for line in process.stdout:
            event = parse(line)
            if isinstance(event, StartEvent):
                timeline.start(event.world_size)
            elif isinstance(event, StepEvent):
                timeline.step(event.step, event.step_s, event.loss)
                position = event.step
                if kill_at is not None and event.step == kill_at:
                    os.killpg(process.pid, signal.SIGKILL)  # a worker (and with it the job) is gone
                    break
        process.wait()
        if after == 0:
            break
        devices = devices - 1 if after is None else after
    figures = timeline.figures(steps)
    figures["final_step"] = position
    return figures


def static_run(store: Path, steps: int) -> tuple[dict[int, float], float]:
    """The job on START_DEVICES workers throughout: every step's loss, and its wall time beyond
    its median step (`Timeline.excess_s`)."""
    from parashift.launcher.launch import launch_workers
    from parashift.specs.plan import Plan
    from parashift.trainer.events import StepEvent, WorkerEvent

    timeline = Timeline()
    timeline.start(START_DEVICES)

    def listen(event: WorkerEvent) -> None:
        if isinstance(event, StepEvent):
            timeline.step(event.step, event.step_s, event.loss)

    result = launch_workers(job_spec("trace-static", store, steps), Plan.data_parallel(START_DEVICES), on_event=listen)
    if len(result.steps) != steps:
        raise SystemExit(f"the static run trained {len(result.steps)} of {steps} steps (exit code {result.returncode})")
    return {e.step: e.loss for e in result.steps}, timeline.excess_s()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--systems", default="parashift,relaunch,stop_restart", help="which to run, comma-separated")
    args = parser.parse_args()
    chosen = set(args.systems.split(","))
    rounds: dict[str, list[dict[str, Any]]] = {k: [] for k in ("parashift", "relaunch", "stop_restart") if k in chosen}
    equal = True
    with tempfile.TemporaryDirectory(prefix="parashift-trace-") as tmp, bench_prefect_server(Path(tmp)):
        static: dict[int, float] = {}
        excesses: list[float] = []
        for i in range(args.rounds):  # alternating, so machine drift hits every system (and the static run) alike
            losses, excess = static_run(Path(tmp, f"static{i}"), args.steps)
            equal = equal and (losses == static or not static)
            static = static or losses
            excesses.append(excess)
            print("static", json.dumps({"excess_s": round(excess, 3)}), file=sys.stderr, flush=True)
            for name, warm in (("parashift", True), ("relaunch", False)):
                if name not in chosen:
                    continue
                figures, losses = relaunch_round(Path(tmp, f"{name}{i}"), args.steps, i, warm)
                equal = equal and sorted(losses) == sorted(static) and all(
                    abs(losses[s] - static[s]) <= 1e-5 * abs(static[s]) for s in static)
                rounds[name].append(figures)
                print(name, json.dumps(figures), file=sys.stderr, flush=True)
            if "stop_restart" in chosen:
                figures = stop_restart_round(Path(tmp, f"dcp{i}"), args.steps, i)
                rounds["stop_restart"].append(figures)
                print("stop_restart", json.dumps(figures), file=sys.stderr, flush=True)

    static_excess_s = statistics.median(excesses)
    for runs in rounds.values():
        for r in runs:
            r["goodput"] = round((r["ideal_s"] + static_excess_s) / r["wall_s"], 4)

    def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
        changes = len(runs[0]["downtimes_s"])
        planned = [k for k, (_, devices, _) in enumerate(TRACE) if devices is not None]
        return {
            "wall_s": round(statistics.median(r["wall_s"] for r in runs), 3),
            "downtimes_s": [round(statistics.median(r["downtimes_s"][k] for r in runs), 3) for k in range(changes)],
            "median_downtime_s": round(statistics.median(d for r in runs for d in r["downtimes_s"]), 3),
            "median_planned_downtime_s": round(statistics.median(r["downtimes_s"][k] for r in runs for k in planned), 3),
            "retrained_steps": statistics.median(r["retrained_steps"] for r in runs),
            "goodput": round(statistics.median(r["goodput"] for r in runs), 4),
            "goodput_median_steps": round(statistics.median(r["goodput_median_steps"] for r in runs), 4),
            "rounds": runs,
        }

    systems = {name: summary(runs) for name, runs in rounds.items()}
    print(json.dumps({
        "bench": "trace",
        "machine": f"{platform.machine()} {os.cpu_count()} cores",
        "systems": systems,
        "losses_equal_static": equal,
        "static_excess_s": round(static_excess_s, 3),
        "static_excess_s_rounds": [round(e, 3) for e in excesses],
        "trace": [{"at_step": at, "devices": devices, "reason": reason} for at, devices, reason in TRACE],
        "start_devices": START_DEVICES, "steps": args.steps, "checkpoint_every": CHECKPOINT_EVERY,
    }))


if __name__ == "__main__":
    main()
