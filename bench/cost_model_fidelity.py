"""How well the planner's cost model ranks plans: measured step time of distinct plans on 4 CPU
workers against the planner's estimate for each, Spearman rank correlation, and a calibration
fitted to the measurements.

The plans are the planner's own: `planner.search.candidates` (unpruned) gives the best per-op
strategy of every mesh (pp x dp x tp = 4) and micro-batch count, `to_plan` turns each into the Plan the
trainer executes (estimated_step_s included), plus the Megatron baseline. The profile is the
one `tasks/profile` builds for a job: this machine's measured GEMM rate and memory bandwidth
(`measure=True`) shared among the workers that outnumber the cores (`share_cores`), and
collectives and point-to-point sends measured on 4 real workers (`trainer.measure_comm`).

Calibration: measured ~ a x compute + b x op evaluations + c x tensor-parallel op evaluations,
least squares with non-negative factors. Compute is the planner's per-op figure on the slowest
stage; op evaluations = ops on that stage x (micro-batches + stages - 1), the fixed cost per op
(Python, dispatch, DTensor hooks, pipeline sends) a roofline leaves out; tensor-parallel op
evaluations count the ops split over "tp", each of which costs collectives whose time on gloo
with 4 processes on 2 cores is latency and scheduling, not bytes. (The planner's
bandwidth-based communication estimate, tried as a feature, did not rank the plans: see
BENCHMARKS.md.) The calibrated ranking is reported in-sample and leave-one-out. Last line: one
JSON object.

Measured: the median step time of the steps after warm-up on rank 0, in each of `--passes`
passes over the plans (alternating order, each run a fresh job); a plan's fastest pass counts,
since other work on a shared machine only slows a pass down (the per-pass Spearman, and the
cores other processes kept busy during each run, are in the JSON).

    OMP_NUM_THREADS=1 python -m bench.cost_model_fidelity [--steps 12] [--max-plans 9] [--passes 2]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import tempfile
import time

import numpy as np
from parashift.bench.machine import busy_cpu_s
from parashift.launcher.launch import launch_workers, measure_comm_timings
from parashift.models.plans import job_plan_refusals
from parashift.planner.comm import comm_model_from_timings
from parashift.planner.profile import ModelProfile, profile_gpt, share_cores
from parashift.planner.search import baselines, candidates, spaces, to_plan
from parashift.specs import JobSpec
from parashift.specs.plan import Plan, plan_refusals

DEVICES = 4
MODEL = {"n_layers": 4, "d_model": 128, "n_heads": 4, "vocab_size": 256, "seq_len": 48}
GLOBAL_BATCH = 16
PRECISION = "fp32"  # the spec's default: what bench_spec runs
WARMUP_STEPS = 3  # first steps pay for the first collectives, allocator growth, shape inference


def bench_spec(steps: int, store: str, model: dict | None = None) -> JobSpec:
    return JobSpec.model_validate({
        "name": "bench-fidelity",
        "model": model or MODEL,
        "data": {"url": "builtin://python-stdlib", "max_bytes": 2_000_000},
        # one micro-batch per rank unless the plan pipelines: the planner costs exactly that
        "training": {"global_batch": GLOBAL_BATCH, "micro_batch": GLOBAL_BATCH, "steps": steps, "checkpoint_every": 10_000},
        "resources": {"devices": DEVICES, "kind": "cpu"},
        "parallelism": {"precision": PRECISION},
        "storage": {"url": store},
    })


def plan_name(plan: Plan) -> str:
    mesh = "x".join(f"{'fsdp' if axis == 'dp' and plan.dp_shard > 1 else axis}{n}" for axis, n in plan.mesh.items())
    if plan.dp_shard > 1 and not plan.reshard_after_forward:
        mesh += "-held"  # FSDP keeps the gathered weights (no reshard after forward)
    if plan.activation_checkpointing != "none":
        mesh += f"-ac-{plan.activation_checkpointing}"
    # Job names allow [a-z0-9._-]: a strategy such as "pase-dp+accumulation" loses its "+".
    return f"{mesh}-m{plan.micro_batches}" if plan.degree("pp") > 1 else f"{mesh}-{plan.strategy.replace('+', '-')}"


def planner_plans(profile: ModelProfile, max_plans: int, spec: JobSpec | None = None,
                  limit: float | None = None, ac_modes: tuple[str, ...] = ("none",)) -> dict[str, Plan]:
    """Each mesh's best strategy and micro-batch count as the planner emits it, in every space
    it searches (dp replicating the weights, dp sharding them with and without resharding after
    forward; each activation checkpointing mode of `ac_modes`); runnable ones that fit `limit`."""
    base = baselines(profile, DEVICES, None)
    pool = []
    for space in spaces(profile, True, ac_modes):
        for cand in candidates(space, DEVICES, limit, None, None, "dp", prune=False):
            cand.activation_checkpointing = space.activation_checkpointing
            pool.append(cand)
    pool += [c for c in base.values() if c is not None]
    plans: dict[str, Plan] = {}
    for cand in sorted((c for c in pool if c.fits(limit)), key=lambda c: c.time_s):
        plan = to_plan(cand, DEVICES, base, limit, profile.graph)
        sizes = {k: MODEL[k] for k in ("n_layers", "n_heads", "seq_len")}
        refused = job_plan_refusals(plan, spec) if spec is not None else plan_refusals(plan, **sizes, global_batch=GLOBAL_BATCH)
        if plan_name(plan) not in plans and not refused:
            plans[plan_name(plan)] = plan
    # keep the spread: the fastest, the slowest and evenly in between
    names = list(plans)
    if len(names) > max_plans:
        keep = {names[round(i * (len(names) - 1) / (max_plans - 1))] for i in range(max_plans)}
        plans = {n: p for n, p in plans.items() if n in keep}
    return plans


def features(plan: Plan) -> tuple[float, float, float]:
    """(compute s, op evaluations, tensor-parallel op evaluations) on the slowest stage of the
    plan as the trainer runs it (to_plan gives the planner's plans their executed form)."""
    stages: dict[int, list] = {}
    for p in plan.placements:
        stages.setdefault(p.stage, []).append(p)
    slowest = max(stages.values(), key=lambda ops: sum(o.compute_s + o.comm_s for o in ops))
    weight = plan.micro_batches + plan.degree("pp") - 1
    compute = sum(o.compute_s for o in slowest)
    tp_ops = sum(1 for o in slowest if any("tp" in axes for axes in o.splits.values()))
    return compute, float(len(slowest) * weight), float(tp_ops * weight)


def spearman(a: list[float], b: list[float]) -> float:
    """Rank correlation (ties share their mean rank)."""
    def ranks(x: list[float]) -> np.ndarray:
        order = np.argsort(x, kind="stable")
        r = np.empty(len(x))
        r[order] = np.arange(len(x), dtype=float)
        for value in set(x):  # average tied ranks
            idx = [i for i, v in enumerate(x) if v == value]
            r[idx] = r[idx].mean()
        return r

    ra, rb = ranks(a), ranks(b)
    return float(np.corrcoef(ra, rb)[0, 1])


def fit_nonnegative(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with factors >= 0: drop the most negative factor and refit until none is."""
    active = list(range(x.shape[1]))
    while True:
        coef = np.zeros(x.shape[1])
        coef[active] = np.linalg.lstsq(x[:, active], y, rcond=None)[0]
        if (coef >= 0).all():
            return coef
        active.remove(int(np.argmin(coef)))


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def measure(plan: Plan, spec: JobSpec, name: str) -> tuple[float, float | None]:
    """Median step time after warm-up on rank 0, and the cores other processes kept busy
    meanwhile on average (the machine's busy CPU time less the workers', over the run)."""
    busy, ours, start = busy_cpu_s(), _children_cpu_s(), time.perf_counter()
    result = launch_workers(spec.model_copy(update={"name": f"fidelity-{name}"}), plan)
    if result.returncode != 0:
        raise RuntimeError(f"plan {name} failed with {result.returncode}")
    wall, now = time.perf_counter() - start, busy_cpu_s()
    others = None if busy is None or now is None else max(0.0, (now - busy) - (_children_cpu_s() - ours)) / wall
    return statistics.median(e.step_s for e in result.steps[WARMUP_STEPS:]), others


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--max-plans", type=int, default=9)
    parser.add_argument("--passes", type=int, default=2, help="measurements of each plan; the fastest counts")
    args = parser.parse_args()
    # As `tasks/profile` builds it for a job: GEMM rate and bandwidth measured here and shared
    # among the workers on these cores, collectives measured on 4 real workers.
    comm = comm_model_from_timings(measure_comm_timings(DEVICES, "cpu"))
    profile = profile_gpt(**MODEL, batch=GLOBAL_BATCH, device_kind="cpu", measure=True, comm=comm,
                          precision=PRECISION)
    profile = profile.model_copy(update={"device": share_cores(profile.device, DEVICES)})
    p2p = profile.comm.p2p or profile.comm.intra
    print(f"profile: {profile.device.matmul_flops / 1e9:.1f} GFLOP/s per worker (core share "
          f"{profile.device.core_share:.2f}), op overhead {profile.device.op_overhead_s * 1e3:.2f} ms, collectives "
          f"{profile.comm.intra.latency_s * 1e3:.2f} ms + {profile.comm.intra.bandwidth_Bps / 1e9:.2f} GB/s, "
          f"point to point {p2p.latency_s * 1e3:.2f} ms + {p2p.bandwidth_Bps / 1e9:.2f} GB/s", flush=True)
    plans = planner_plans(profile, args.max_plans)
    # Every pass measures every plan (alternating order) and each plan keeps its fastest pass:
    # other work on a shared machine only ever slows a pass down.
    passes: dict[str, list[float]] = {name: [] for name in plans}
    others: dict[str, list[float | None]] = {name: [] for name in plans}
    with tempfile.TemporaryDirectory(prefix="parashift-fidelity-") as tmp:
        spec = bench_spec(args.steps, f"file://{tmp}/store")
        for k in range(args.passes):
            order = list(plans) if k % 2 == 0 else list(reversed(plans))
            for name in order:
                step, busy = measure(plans[name], spec, f"{name}-{k}")  # own job each: no resume
                passes[name].append(step)
                others[name].append(busy)
                print(f"pass {k}: {name:28s} estimated {plans[name].estimated_step_s * 1e3:8.2f} ms  measured "
                      f"{step * 1e3:8.2f} ms  (other processes: {'?' if busy is None else f'{busy:.2f}'} cores)",
                      flush=True)
    rows = [{"plan": name, "mesh": plan.mesh, "micro_batches": plan.micro_batches, "estimated_s": plan.estimated_step_s,
             "measured_s": min(passes[name]), "passes_s": passes[name], "other_cores": others[name]}
            for name, plan in plans.items()]
    est = [r["estimated_s"] for r in rows]
    meas = [r["measured_s"] for r in rows]
    x = np.array([features(plans[r["plan"]]) for r in rows])
    y = np.array(meas)
    coef = fit_nonnegative(x, y)
    calibrated = (x @ coef).tolist()
    loo = []
    for i in range(len(rows)):
        keep = [j for j in range(len(rows)) if j != i]
        loo.append(float(x[i] @ fit_nonnegative(x[keep], y[keep])))
    for r, c, o in zip(rows, calibrated, loo, strict=True):
        r["calibrated_s"], r["calibrated_loo_s"] = c, o
    result = {
        "benchmark": "cost_model_fidelity",
        "devices": DEVICES,
        "model": MODEL,
        "global_batch": GLOBAL_BATCH,
        "device_model": profile.device.model_dump(),
        "comm_model": profile.comm.model_dump(),
        "passes": args.passes,
        "spearman": round(spearman(est, meas), 4),
        # each pass on its own: how much the ranking owes to the measurement's noise
        "spearman_per_pass": [round(spearman(est, [r["passes_s"][k] for r in rows]), 4) for k in range(args.passes)],
        "spearman_calibrated": round(spearman(calibrated, meas), 4),
        "spearman_calibrated_loo": round(spearman(loo, meas), 4),
        "calibration": {"compute_scale": coef[0], "per_op_evaluation_s": coef[1], "per_tp_op_evaluation_s": coef[2]},
        "plans": rows,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
