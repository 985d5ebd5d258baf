"""From a resource event to the first training step under the new Plan, on CPU workers.

A real `prefect server` (started here, temporary home, 127.0.0.1), the `train-job` flow in this
process, a GPT with AdamW (~293 MB of state) training on `--from` workers. A few steps in, a
`parashift.resources.changed` event asks for `--to` devices (sent as `parashift scale` sends it).
The time from that event to the first step of the new segment is split into:

- stop_s: event -> the old workers have exited (delivery over the websocket, the stop request,
  the workers' next stop check at a step boundary, their final checkpoint, torchrun's exit);
- plan_s: the old launch's end -> the new launch's start (re-planning, the reshard plan, the
  flow's own bookkeeping), from Prefect's task-run times;
- reshard_data_s: the new workers' restore (reading and placing the state), as they report it;
- relaunch_s: the rest of the new launch until its first step is done (torchrun, imports,
  process groups, model build, and that first step).

    OMP_NUM_THREADS=1 python -m bench.rescale_latency [--from 4] [--to 3] [--rounds 3]
    OMP_NUM_THREADS=1 python -m bench.rescale_latency --node-leave [--rounds 3]
    OMP_NUM_THREADS=1 python -m bench.rescale_latency --strategy auto --profiled both [--rounds 3]

`--strategy auto`: the planner chooses, from a profile with collectives measured on the job's own
workers. `--profiled yes`: the new count's profile is built before the job starts (as after an
earlier change to it); `no`: the change is the first to that count; `both`: each round runs
both, one after the other, and the medians of each are reported (`profiled` / `unprofiled`).

`--node-leave`: the same job across two nodes of two workers (two Prefect node workers on this
machine, rendezvous on 127.0.0.1, node-local tiers); once its checkpoint at step 2 is committed,
node b's worker is killed (SIGKILL). The breakdown is the same, from the kill: stop_s until the
failed launch has ended (node b's launcher stops its workers, node a's fail on the lost peer,
both report), plan_s, reshard_data_s and relaunch_s of the launch on node a alone (its first step
as node a's launcher heard it).

The last line of output is one JSON object: `stop_s`, `plan_s`, `reshard_data_s`,
`relaunch_s`, `total_s` (medians over the rounds) and every round's figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from parashift.bench.prefect_server import bench_prefect_server
from parashift.specs import environ

from parashift.commands.serve import deploy_all, start_node_worker, stop_group

MODEL = {"n_layers": 3, "d_model": 768, "n_heads": 12, "vocab_size": 2048, "seq_len": 24, "dropout": 0.0}
EVENT_AT_STEP = 3  # steps into the first segment
STOP_POLL_S = 2.0  # how often rank 0 checks the stop object (the spec's default): part of stop_s


def one_round(store: Path, devices_from: int, devices_to: int, steps: int, round_no: int,
              strategy: str = "data-parallel", profiled: bool = False) -> dict[str, Any]:
    from parashift.flows.train import train_job
    from parashift.specs import JobSpec
    from parashift.tasks import progress
    from parashift.tasks.events import ResourceEvent, emit_resource_change, now_epoch
    from parashift.trainer.events import StartEvent, StepEvent, StoppedEvent, WorkerEvent
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    spec = JobSpec.model_validate({
        "name": f"rescale-latency-{round_no}",
        "model": MODEL,
        "data": {"url": "builtin://python-stdlib", "max_bytes": 200_000},
        "training": {"global_batch": 12, "micro_batch": 2, "steps": steps, "checkpoint_every": 1000,
                     "stop_poll_s": STOP_POLL_S},
        "resources": {"devices": devices_from, "kind": "cpu"},
        "parallelism": {"strategy": strategy},
        "storage": {"url": f"file://{store}"},
    })
    if profiled:  # the new count's profile exists before the change, as after an earlier change to it
        from parashift.tasks.profile import ensure_profile

        ensure_profile(spec.on_devices(devices_to))
    seen: list[tuple[float, WorkerEvent]] = []
    emitted: list[float] = []

    def listen(event: WorkerEvent) -> None:
        seen.append((time.time(), event))
        if isinstance(event, StepEvent) and event.step == EVENT_AT_STEP and not emitted:
            emitted.append(time.time())
            threading.Thread(target=emit_resource_change,
                             args=(spec.job_id, ResourceEvent(devices=devices_to, epoch=now_epoch()))).start()

    progress.add_listener(listen)
    try:
        state = train_job(spec, return_state=True)
    finally:
        progress.remove_listener(listen)
    summary = state.result()
    if [s.devices for s in summary.segments] != [devices_from, devices_to]:
        raise RuntimeError(f"expected one change {devices_from} -> {devices_to}, got {summary.segments}")
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id])))
    launches = sorted((r for r in runs if r.name.startswith("launch-training")), key=lambda r: r.start_time)
    old_end, new_start = launches[0].end_time.timestamp(), launches[1].start_time.timestamp()
    starts = [(t, e) for t, e in seen if isinstance(e, StartEvent)]
    new_start_event = starts[1][1]
    first_new_step = next(t for t, e in seen if isinstance(e, StepEvent) and t > starts[1][0])
    reshard = new_start_event.restore_s or 0.0
    out = {
        "stop_s": old_end - emitted[0],
        "plan_s": new_start - old_end,
        "reshard_data_s": reshard,
        "relaunch_s": first_new_step - new_start - reshard,
        "total_s": first_new_step - emitted[0],
        "stopped_at_step": summary.segments[0].final_step,
        "stopped_event_s": next(t for t, e in seen if isinstance(e, StoppedEvent)) - emitted[0],
        "worker_phases": new_start_event.phases,
        "event_at_step": EVENT_AT_STEP,
        "strategy": strategy,
        "profiled": profiled,
    }
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}), file=sys.stderr, flush=True)
    return out


def node_leave_round(store: Path, steps: int, round_no: int, workers: dict[str, Any]) -> dict[str, Any]:
    from parashift.flows.train import train_job
    from parashift.specs import JobSpec
    from parashift.tasks.nodes import NodeReport
    from parashift.trainer.events import StartEvent, StepEvent
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    spec = JobSpec.model_validate({
        "name": f"node-leave-{round_no}",
        "model": MODEL,
        "data": {"url": "builtin://python-stdlib", "max_bytes": 200_000},
        "training": {"global_batch": 12, "micro_batch": 2, "steps": steps, "checkpoint_every": 2},
        "resources": {"devices": 4, "kind": "cpu", "nodes": ["a", "b"]},
        "storage": {"url": f"file://{store}", "local_tier": f"{store}-tier-{{node}}"},
    })
    manifest = store / "jobs" / spec.job_id / "ckpt" / f"{2:08d}" / "manifest.json"
    killed: list[float] = []

    def kill_node_b() -> None:
        while not manifest.exists():
            time.sleep(0.05)
        killed.append(time.time())
        workers["b"].kill()
        workers["b"].wait()

    threading.Thread(target=kill_node_b, daemon=True).start()
    state = train_job(spec, return_state=True)
    summary = state.result()
    if [s.nodes for s in summary.segments] != [["a", "b"], ["a"]]:
        raise RuntimeError(f"expected node b to leave once, got {summary.segments}")
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id])))
    launches = sorted((r for r in runs if r.name.startswith("launch-training")), key=lambda r: r.start_time)
    old_end, new_start = launches[0].end_time.timestamp(), launches[1].start_time.timestamp()
    reports = sorted((store / "jobs" / spec.job_id / "launches").glob("*/node-a.json"))
    report = NodeReport.model_validate_json(reports[-1].read_text())
    start = next(e for e in report.events if isinstance(e, StartEvent))
    first_step = next(e.received_at for e in report.events if isinstance(e, StepEvent) and e.received_at is not None)
    restore_s = start.restore_s or 0.0
    out = {
        "stop_s": old_end - killed[0],
        "plan_s": new_start - old_end,
        "reshard_data_s": restore_s,
        "relaunch_s": first_step - new_start - restore_s,
        "total_s": first_step - killed[0],
        "resumed_at_step": summary.segments[1].start_step,
        "restore_bytes": summary.segments[1].restore_bytes,
        "worker_phases": start.phases,
    }
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}), file=sys.stderr, flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from", dest="devices_from", type=int, default=4)
    parser.add_argument("--to", dest="devices_to", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--node-leave", action="store_true", help="2 nodes x 2 workers; node b's worker is killed")
    parser.add_argument("--strategy", default="data-parallel", help="the job's parallelism.strategy (auto: the planner's)")
    parser.add_argument("--profiled", choices=("yes", "no", "both"), default="no",
                        help="whether the new count's profile exists before the change (both: each round, both ways)")
    args = parser.parse_args()
    variants = {"yes": [True], "no": [False], "both": [True, False]}[args.profiled]
    workers: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="parashift-rescale-") as tmp, bench_prefect_server(Path(tmp)):
        try:
            if args.node_leave:
                node_env = {**os.environ, environ.NODE_ADDR: "127.0.0.1", "PREFECT_WORKER_QUERY_SECONDS": "1"}
                deploy_all(node_env)
                rounds = []
                for i in range(args.rounds):
                    for node in ("a", "b"):  # node b comes back for every round
                        if node not in workers or workers[node].poll() is not None:
                            workers[node] = start_node_worker(node, {**node_env, "PREFECT_HOME": str(Path(tmp, node))})
                    rounds.append(node_leave_round(Path(tmp, f"store{i}"), args.steps, i, workers))
            else:
                rounds = [one_round(Path(tmp, f"store{i}-{int(profiled)}"), args.devices_from, args.devices_to, args.steps,
                                    2 * i + int(profiled), args.strategy, profiled)
                          for i in range(args.rounds) for profiled in (variants if i % 2 == 0 else variants[::-1])]
        finally:
            for process in workers.values():
                stop_group(process)
    keys = ("stop_s", "plan_s", "reshard_data_s", "relaunch_s", "total_s")
    result = {
        "bench": "rescale_latency",
        "machine": f"{platform.machine()} {os.cpu_count()} cores",
        "change": "node b of 2 x 2 cpu workers left (worker killed)" if args.node_leave else
                  f"{args.devices_from}->{args.devices_to} cpu workers",
        "stop_poll_s": STOP_POLL_S,
        **{k: round(statistics.median(r[k] for r in rounds), 3) for k in keys},
        "all_but_data_s": round(statistics.median(r["total_s"] - r["reshard_data_s"] for r in rounds), 3),
        "rounds": [{k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()} for r in rounds],
    }
    if len(variants) == 2 and not args.node_leave:  # a count profiled before vs one never profiled
        for name, want in (("profiled", True), ("unprofiled", False)):
            result[name] = {k: round(statistics.median(r[k] for r in rounds if r["profiled"] is want), 3) for k in keys}
        result["unprofiled_minus_profiled_s"] = {
            k: round(result["unprofiled"][k] - result["profiled"][k], 3) for k in ("plan_s", "total_s")}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
