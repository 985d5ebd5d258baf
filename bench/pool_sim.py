"""A shared GPU pool, simulated: a seeded job trace replayed through the pool's own allocator
(`pool.allocator`, the code the controller runs) against static FIFO, on the same trace.

Three systems:
- `static`: FIFO, each job its requested devices for its whole run, no backfill;
- `pool-parashift`: the allocator on every arrival and completion; a change of a job's device
  count costs parashift's planned-change downtime plus reading the state at the new size;
- `pool-stop-restart`: the same allocator where a change costs a stop-and-restart: the
  measured restart overhead of bench/dcp_restart.py, a full save and a full load.

Step times come from the cost model (`planner.pinned.estimate`): three model archetypes on H100/
H200-class devices of 80 GiB, FSDP over n devices with FSDP2's bf16 policy and selective
activation checkpointing, one sequence per micro-batch, a fixed global batch; a count whose
estimate does not fit in memory does not exist for that model.

The trace (seeded): Poisson arrivals at 20 jobs per hour per 64 GPUs (Pollux's and Sia's
workloads: 160 jobs over 8 h on 64 GPUs, `petuum/adaptdl@osdi21-artifact simulator/workload.py`,
`siasosp23/artifacts workloads/saturn`), scaled with the cluster; requested GPUs from the
Microsoft Philly trace as Pollux's extract gives it (`simulator/traces/philly.csv`, 82,247 jobs:
1 GPU 93.17%, 2 2.21%, 4 2.27%, 8 2.00%, 16 0.24%, more 0.10%); durations log-normal through
Philly's median 1,144 s and 75th percentile 2,932 s (the same extract), kept within Pollux's
filter (at least 60 s, under 1,000 GPU-hours); the model by GPU-time as Pollux assigns it (under
1 GPU-hour the small model, under 10 the medium one, else the large). 10% of jobs have priority 1.

    python -m bench.pool_sim [--gpus 1024] [--jobs 1000] [--seed 0]

Last line JSON: per system mean and median JCT, makespan, changes; both pools' ratios to static;
and the allocator's decision time at 4,096 GPUs and 1,000 jobs.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from parashift.pool.allocator import PoolJob, PoolPolicy, allocate
from parashift.pool.change_cost import change_downtime_s, state_bytes

GIB = 2**30
DEVICE_MEMORY_GB = 80.0
COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Requested GPUs per job: Philly as Pollux's extract has it ("more" taken as 32).
PHILLY_SIZES = ((1, 0.9317), (2, 0.0221), (4, 0.0227), (8, 0.0200), (16, 0.0024), (32, 0.0010))
PHILLY_MEDIAN_S, PHILLY_P75_S = 1144.0, 2932.0
JOBS_PER_HOUR_PER_64_GPUS = 20.0
# Change costs are the live pool's (`pool.change_cost`). parashift: a planned change's downtime on
# warm workers plus reading the state at the new size. Stop-and-restart: bench/dcp_restart.py's
# median downtime, plus a full save and load.
DISK_BPS = 1.18e9  # per device: the local disk's write with fsync here (FACTS.md); reads taken alike

ARCHETYPES: dict[str, dict[str, Any]] = {
    "small": {"model": {"family": "gpt", "n_layers": 12, "d_model": 768, "n_heads": 12, "vocab_size": 50304,
                        "seq_len": 1024}, "global_batch": 64},
    "medium": {"model": {"family": "llama", "n_layers": 16, "d_model": 2048, "n_heads": 32, "n_kv_heads": 8,
                         "ffn_dim": 8192, "vocab_size": 128256, "seq_len": 2048, "tie_embeddings": True},
               "global_batch": 128},
    "large": {"model": {"family": "llama", "n_layers": 32, "d_model": 4096, "n_heads": 32, "n_kv_heads": 8,
                        "ffn_dim": 14336, "vocab_size": 128256, "seq_len": 8192}, "global_batch": 256},
}


@functools.cache
def archetype_curve(name: str) -> tuple[dict[int, float], float]:
    """Seconds per step at each device count whose plan fits, and the training state's bytes."""
    from parashift.models import family_of
    from parashift.planner.pinned import estimate
    from parashift.planner.profile import profile_graph
    from parashift.specs import JobSpec
    from parashift.specs.plan import Plan

    arch = ARCHETYPES[name]
    batch = arch["global_batch"]
    spec = JobSpec.model_validate({"name": f"sim-{name}", "model": arch["model"],
                                   "training": {"global_batch": batch, "micro_batch": 1},
                                   "parallelism": {"precision": "bf16", "mixed_precision": "fsdp"}})
    graph = family_of(spec.model).graph(spec.model, batch, "bf16")
    profile = profile_graph(graph, "cuda", memory_gb=DEVICE_MEMORY_GB)
    limit = spec.parallelism.plan_memory_bytes(profile.device.memory_bytes)
    curve = {}
    for n in COUNTS:
        if n > batch:
            break
        plan = Plan(devices=n, mesh={"dp": n}, dp_shard=n if n > 1 else 1, strategy="hand",
                    activation_checkpointing="selective", mixed_precision="fsdp", micro_batches=batch // n)
        result = estimate(profile, plan, "fsdp")  # on one device (no data axis) autocast, as it runs
        if limit is None or result.memory_bytes <= limit:
            curve[n] = result.time_s
    return curve, state_bytes(graph.n_params)


@dataclass
class SimJob:
    job_id: str
    arrival: float
    archetype: str
    requested: int
    steps: float
    priority: int
    step_s: dict[int, float]
    state_bytes: float
    done: float = 0.0
    devices: int = 0
    paused_until: float = 0.0
    started: bool = False
    finished_at: float | None = None
    changes: int = 0

    @property
    def min_devices(self) -> int:
        return min(self.step_s)

    def left_s(self, now: float) -> float:
        return max(now, self.paused_until) - now + (self.steps - self.done) * self.step_s[self.devices]


def make_trace(n_jobs: int, gpus: int, seed: int) -> list[SimJob]:
    rng = random.Random(seed)
    rate_per_s = JOBS_PER_HOUR_PER_64_GPUS * gpus / 64 / 3600
    sigma = math.log(PHILLY_P75_S / PHILLY_MEDIAN_S) / 0.6745  # the normal's 75th percentile
    sizes, weights = zip(*PHILLY_SIZES, strict=True)
    jobs, t = [], 0.0
    while len(jobs) < n_jobs:
        t += rng.expovariate(rate_per_s)
        requested = rng.choices(sizes, weights)[0]
        duration = rng.lognormvariate(math.log(PHILLY_MEDIAN_S), sigma)
        if duration < 60 or duration * requested >= 1000 * 3600:
            continue
        gpu_hours = duration * requested / 3600
        archetype = "small" if gpu_hours < 1 else "medium" if gpu_hours < 10 else "large"
        curve, state = archetype_curve(archetype)
        requested = min((n for n in curve if n >= requested), default=max(curve))
        steps = duration / curve[requested]
        jobs.append(SimJob(f"job{len(jobs):05d}", t, archetype, min(requested, gpus), steps,
                           1 if rng.random() < 0.1 else 0, curve, state))
    return jobs


def change_cost(job: SimJob, before: int, after: int, model: str) -> float:
    """Downtime of moving `job` from `before` to `after` devices (0: stopped, or waiting)."""
    return change_downtime_s(job.state_bytes, before, after, warm=model == "parashift", read_bytes_per_s=DISK_BPS)


@dataclass
class Run:
    system: str
    gpus: int
    decide_s: list[float] = field(default_factory=list)


def simulate(trace: list[SimJob], gpus: int, system: str, policy: PoolPolicy) -> dict[str, Any]:
    jobs = [SimJob(**{**j.__dict__}) for j in trace]
    arrivals = sorted(jobs, key=lambda j: j.arrival)
    active: list[SimJob] = []
    run = Run(system, gpus)
    now, i = 0.0, 0
    while i < len(arrivals) or active:
        running = [j for j in active if j.devices]
        next_arrival = arrivals[i].arrival if i < len(arrivals) else math.inf
        next_finish = min((now + j.left_s(now) for j in running), default=math.inf)
        later = min(next_arrival, next_finish)
        for j in running:  # progress until then
            j.done += max(later - max(now, j.paused_until), 0.0) / j.step_s[j.devices]
        now = later
        for j in [j for j in running if j.done >= j.steps - 1e-6]:
            j.finished_at, j.devices = now, 0
            active.remove(j)
        while i < len(arrivals) and arrivals[i].arrival <= now:
            active.append(arrivals[i])
            i += 1
        if system == "static":
            _fifo(active, gpus)
        else:
            _pooled(active, gpus, now, policy, system.removeprefix("pool-"), run)
    jct = [j.finished_at - j.arrival for j in jobs if j.finished_at is not None]
    out = {"system": system, "jobs": len(jct), "mean_jct_s": round(statistics.mean(jct), 1),
           "median_jct_s": round(statistics.median(jct), 1),
           "makespan_s": round(max(j.finished_at for j in jobs) - min(j.arrival for j in jobs), 1),
           "changes": sum(j.changes for j in jobs)}
    if run.decide_s:
        out["decide_ms_median"] = round(1e3 * statistics.median(run.decide_s), 2)
        out["decide_ms_max"] = round(1e3 * max(run.decide_s), 2)
    return out


def _fifo(active: list[SimJob], gpus: int) -> None:
    """Strict FIFO: the head of the queue starts when its requested devices are free."""
    free = gpus - sum(j.devices for j in active)
    for j in sorted((j for j in active if not j.started), key=lambda j: j.arrival):
        if j.requested > free:
            break
        j.devices, j.started = j.requested, True
        free -= j.requested


def _pooled(active: list[SimJob], gpus: int, now: float, policy: PoolPolicy, model: str, run: Run) -> None:
    views = [PoolJob(j.job_id, j.step_s, math.ceil(j.steps - j.done), j.arrival, j.priority, j.min_devices,
                     None, j.devices, change_cost(j, j.devices or j.min_devices, j.devices or j.min_devices, model))
             for j in active]
    started = time.perf_counter()
    decision = allocate(views, gpus, now, policy)
    run.decide_s.append(time.perf_counter() - started)
    for j in active:
        after = decision.devices[j.job_id]
        if after == j.devices:
            continue
        if j.devices or j.started:  # a running job changes (or stops); a stopped one resumes
            # a change made while an earlier one is still under way waits for it
            j.paused_until = max(now, j.paused_until) + change_cost(j, j.devices, after, model) if after else now
            j.changes += 1
        j.devices, j.started = after, j.started or after > 0


def decision_time_at_scale(gpus: int = 4096, n_jobs: int = 1000, seed: int = 0) -> float:
    """Median seconds of one decision with `n_jobs` jobs in the pool (every archetype mixed)."""
    trace = make_trace(n_jobs, gpus, seed)
    views = [PoolJob(j.job_id, j.step_s, math.ceil(j.steps), j.arrival, j.priority, j.min_devices, None,
                     j.min_devices if k % 2 else 0, 10.0) for k, j in enumerate(trace)]
    times = []
    for _ in range(5):
        started = time.perf_counter()
        allocate(views, gpus, trace[-1].arrival)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, default=1024)
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--horizon-s", type=float, default=PoolPolicy.horizon_s)
    args = parser.parse_args()
    policy = PoolPolicy(horizon_s=args.horizon_s)
    trace = make_trace(args.jobs, args.gpus, args.seed)
    curves = {name: {str(n): round(s, 4) for n, s in archetype_curve(name)[0].items()} for name in ARCHETYPES}
    print(json.dumps({"step_s": curves}), flush=True)
    results = {}
    for system in ("static", "pool-parashift", "pool-stop-restart"):
        results[system] = simulate(trace, args.gpus, system, policy)
        print(json.dumps(results[system]), flush=True)
    static = results["static"]
    ratios = {system: {"mean_jct": round(r["mean_jct_s"] / static["mean_jct_s"], 3),
                       "makespan": round(r["makespan_s"] / static["makespan_s"], 3)}
              for system, r in results.items() if system != "static"}
    print(json.dumps({"benchmark": "pool_sim", "gpus": args.gpus, "jobs": args.jobs, "seed": args.seed,
                      "horizon_s": policy.horizon_s, "systems": results, "vs_static": ratios,
                      "decide_ms_at_4096_gpus_1000_jobs": round(1e3 * decision_time_at_scale(), 1)}))


if __name__ == "__main__":
    main()
