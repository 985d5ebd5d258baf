"""Plan quality, measured: where the planner's pick ranks among every executable mesh when each
is run, and how far its measured step time is from the fastest.

The cost model's estimates are a means; what users get is the step time of the plan the planner
picks. On 4 CPU workers: the profile a job with `parallelism.strategy: auto` gets (GEMMs timed
here, collectives on 4 real workers), the planner's pick for it (`plan_model`, then the same
executability check the flow applies), and every mesh's best strategy as the planner emits it
(`bench.cost_model_fidelity.planner_plans`: pp x dp x tp = 4, each micro-batch count, plus the
Megatron baseline). Each plan runs as a fresh job; its median step time after warm-up counts,
the fastest of `--passes` passes (other work on a shared machine only slows a pass down).

    OMP_NUM_THREADS=1 python -m bench.plan_quality [--family gpt|llama] [--steps 12] [--passes 2] [--max-plans 12]

`--family llama`: a Llama of the same size (8 query heads in 4 kv groups, SwiGLU), planned from
its own graph (models/llama/graph.py).

Last line: one JSON object with `pick_rank` (1 = fastest measured), `pick_s`, `best_s`,
`ratio` (pick / best; target <= 1.10) and every plan's `estimated_s` and `measured_s`.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile

from parashift.bench.cost_model_fidelity import (
    DEVICES,
    GLOBAL_BATCH,
    MODEL,
    PRECISION,
    bench_spec,
    measure,
    plan_name,
    planner_plans,
)
from parashift.launcher.launch import measure_comm_timings
from parashift.models import family_of
from parashift.planner.comm import comm_model_from_timings
from parashift.planner.profile import profile_graph, share_cores
from parashift.planner.search import plan_model
from parashift.specs.plan import AC_MODES
from parashift.tasks.plan import choose_plan

MODELS = {
    "gpt": MODEL,
    "llama": {"family": "llama", "n_layers": MODEL["n_layers"], "d_model": MODEL["d_model"], "n_heads": 8, "n_kv_heads": 4,
              "ffn_dim": 352, "vocab_size": MODEL["vocab_size"], "seq_len": MODEL["seq_len"]},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--max-plans", type=int, default=12)
    parser.add_argument("--family", default="gpt", choices=sorted(MODELS))
    parser.add_argument("--memory-fraction", type=float, default=None,
                        help="plan under a per-device limit this far (0-1) from the least memory a plan needs with "
                             "full checkpointing to the least it needs without (below 1: only checkpointed plans "
                             "fit); the planner may then checkpoint, and only fitting plans are measured")
    args = parser.parse_args()
    comm = comm_model_from_timings(measure_comm_timings(DEVICES, "cpu"))
    with tempfile.TemporaryDirectory(prefix="parashift-quality-") as tmp:
        spec = bench_spec(args.steps, f"file://{tmp}/store", MODELS[args.family])
        graph = family_of(spec.model).graph(spec.model, GLOBAL_BATCH, PRECISION)
        profile = profile_graph(graph, "cpu", True, comm=comm, tokens=GLOBAL_BATCH * spec.model.seq_len)
        profile = profile.model_copy(update={"device": share_cores(profile.device, DEVICES)})
        auto = spec.model_copy(update={"parallelism": spec.parallelism.model_copy(update={"strategy": "auto"})})
        limit, ac_modes = None, ("none",)
        if args.memory_fraction is not None:
            # Nothing fits 1 byte: the least-memory plan, without checkpointing and with full.
            least = plan_model(profile, DEVICES, 1).memory_per_device_bytes
            least_full = plan_model(profile, DEVICES, 1, ac_modes=("full",)).memory_per_device_bytes
            limit, ac_modes = least_full + args.memory_fraction * (least - least_full), AC_MODES
        searched = plan_model(profile, DEVICES, limit, ac_modes=ac_modes)
        pick = choose_plan(auto, searched, DEVICES).model_copy(
            update={"activation_checkpointing": searched.activation_checkpointing})
        plans = planner_plans(profile, args.max_plans, spec, limit, ac_modes)
        pick_name = plan_name(pick)
        plans.setdefault(pick_name, pick)
        measured: dict[str, list[float]] = {name: [] for name in plans}
        for k in range(args.passes):
            for name in (list(plans) if k % 2 == 0 else list(reversed(plans))):
                step, _ = measure(plans[name], spec, f"q-{name}-{k}")
                measured[name].append(step)
                print(f"pass {k}: {name:28s} estimated {plans[name].estimated_step_s * 1e3:8.2f} ms  "
                      f"measured {step * 1e3:8.2f} ms{'  <- pick' if name == pick_name else ''}", flush=True)
    best = {name: min(times) for name, times in measured.items()}
    ranking = sorted(best, key=best.get)
    result = {
        "benchmark": "plan_quality", "machine": f"{platform.machine()}", "devices": DEVICES, "model": MODELS[args.family],
        "global_batch": GLOBAL_BATCH, "passes": args.passes, "pick": pick_name, "pick_mesh": pick.mesh,
        "memory_limit_bytes": limit, "pick_ac": pick.activation_checkpointing,
        "pick_rank": ranking.index(pick_name) + 1, "plans_measured": len(ranking),
        "pick_s": best[pick_name], "best": ranking[0], "best_s": best[ranking[0]],
        "ratio": round(best[pick_name] / best[ranking[0]], 4),
        "plans": [{"plan": name, "mesh": plans[name].mesh, "micro_batches": plans[name].micro_batches,
                   "ac": plans[name].activation_checkpointing, "memory_bytes": plans[name].memory_per_device_bytes,
                   "estimated_s": plans[name].estimated_step_s, "measured_s": best[name], "passes_s": measured[name]}
                  for name in ranking],
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
