"""Planner benchmark: search time and peak memory on PaSE's Transformer and on GPT-3 175B.

Each case runs in a fresh forked process so its memory is its own: `peak_mb` is that process's
peak resident set (getrusage ru_maxrss), interpreter and imports included (`base_mb` is the
level before the search starts). The last line printed is one JSON object:
{"cases": [{graph, ops, devices, search_s, peak_mb, cost, dp_baseline_cost, megatron_baseline_cost}, ...]}.

    python -m bench.planner [--quick]

Families: PaSE's Transformer (p = 4 .. 512), GPT-3 175B (p = 8 .. 1024, the whole planner with
the H200 memory limit), skip-heavy stacks of 50 and 5,000 ops (PaSE's space, p = 64) and a
20,000-op chain (the whole planner, p = 64 and 512; 1024 wide at p = 64, where the memory limit
binds), and random dense 40-op DAGs, each op reading up to 8 earlier ones (the whole planner,
p = 8 and 64, seeds 0-2; `--only dense`). `proven_optimal` / `lower_bound`: whether
the search proved its answer or stopped at a bound (planner/dp.py solve_bounded,
planner/constrained.py).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import platform
import resource
import time
from typing import Any

PASE_P = (4, 8, 16, 32, 64, 128, 256, 512)
GPT3_P = (8, 64, 512, 1024)
H200_GB = 141  # memory per device for the GPT-3 cases (NVIDIA H200)


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def _pase_case(p: int, family: str = "pase") -> dict[str, Any]:
    """PaSE's space (per-dim split counts, aligned layouts, no memory limit), as in its paper;
    `family` "skip50"/"skip5000": a stack of matmuls each reading the 4 ops before it."""
    from parashift.planner.builders import pase_transformer_graph, skip_graph
    from parashift.planner.configs import counts_mesh, op_configs
    from parashift.planner.profile import profile_graph
    from parashift.planner.search import baselines, search_counts

    g = pase_transformer_graph() if family == "pase" else skip_graph(int(family[4:]))
    prof = profile_graph(g, "cuda")
    base_mb = _rss_mb()
    t0 = time.perf_counter()
    res = search_counts(g, prof, p)
    search_s = time.perf_counter() - t0
    peak = _rss_mb()
    base = baselines(prof, p, None)
    mesh = counts_mesh(p)
    return {
        "graph": g.name, "ops": len(g.ops), "devices": p, "search_s": round(search_s, 3),
        "peak_mb": round(peak, 1), "base_mb": round(base_mb, 1), "cost": res.time_s,
        "lower_bound": res.time_s - res.relaxation_s, "proven_optimal": res.relaxation_s == 0.0,
        "dp_baseline_cost": base["data-parallel"].time_s if base["data-parallel"] else None,
        "megatron_baseline_cost": base["megatron"].time_s if base["megatron"] else None,
        "max_configs_per_op": max(len(op_configs(op, mesh)) for op in g.ops),
        "space": "counts (product of splits divides p)", "memory_limit_gb": None,
    }


def _gpt3_case(p: int) -> dict[str, Any]:
    """The whole planner (meshes, pipelines, per-op DP, memory limit) on GPT-3 175B."""
    from parashift.planner.builders import gpt3_175b_graph
    from parashift.planner.profile import profile_graph
    from parashift.planner.search import plan_model

    g = gpt3_175b_graph()
    prof = profile_graph(g, "cuda", memory_gb=H200_GB)
    base_mb = _rss_mb()
    t0 = time.perf_counter()
    plan = plan_model(prof, p)  # dp may replicate or shard (FSDP) the weights
    search_s = time.perf_counter() - t0
    replicated = plan_model(prof, p, shard_dp=False)  # the space before FSDP, for comparison
    shallow = plan_model(prof, p, max_pp=8)  # what fits without a pipeline deeper than 8

    def brief(other: Any) -> dict[str, Any]:
        return {"mesh": other.mesh, "dp_shard": other.dp_shard, "reshard_after_forward": other.reshard_after_forward,
                "micro_batches": other.micro_batches, "cost": other.estimated_step_s, "feasible": other.feasible,
                "memory_per_device_gb": round(other.memory_per_device_bytes / 2**30, 1)}

    return {
        "graph": "gpt3-175b", "ops": len(g.ops), "devices": p, "search_s": round(search_s, 3),
        "dp_shard": plan.dp_shard, "reshard_after_forward": plan.reshard_after_forward,
        "replicated_only": brief(replicated), "pp_at_most_8": brief(shallow),
        "peak_mb": round(_rss_mb(), 1), "base_mb": round(base_mb, 1), "cost": plan.estimated_step_s,
        "dp_baseline_cost": plan.baselines.get("data-parallel"),
        "megatron_baseline_cost": plan.baselines.get("megatron"),
        "mesh": plan.mesh, "micro_batches": plan.micro_batches, "feasible": plan.feasible,
        "proven_optimal": plan.proven_optimal, "lower_bound": plan.lower_bound_s,
        "memory_per_device_gb": round(plan.memory_per_device_bytes / 2**30, 1),
        "baseline_memory_gb": {k: round(v / 2**30, 1) for k, v in plan.baseline_memory_bytes.items()},
        "memory_limit_gb": H200_GB,
    }


def _chain_case(p: int, d_model: int = 256) -> dict[str, Any]:
    """The whole planner on a 20,000-op chain of matmuls (no blocks: the elimination order's
    scaling), H200 memory limit. `d_model` 1024: the weights (335 GB) must be sharded, some
    ops more than others, so the constrained search runs on every mesh."""
    from parashift.planner.builders import chain_graph
    from parashift.planner.profile import profile_graph
    from parashift.planner.search import plan_model

    g = chain_graph(20_000, d_model=d_model)
    prof = profile_graph(g, "cuda", memory_gb=H200_GB)
    base_mb = _rss_mb()
    t0 = time.perf_counter()
    plan = plan_model(prof, p)
    search_s = time.perf_counter() - t0
    return {"graph": g.name, "ops": len(g.ops), "devices": p, "search_s": round(search_s, 3), "peak_mb": round(_rss_mb(), 1),
            "base_mb": round(base_mb, 1), "cost": plan.estimated_step_s, "mesh": plan.mesh, "dp_shard": plan.dp_shard,
            "proven_optimal": plan.proven_optimal, "lower_bound": plan.lower_bound_s,
            "dp_baseline_cost": plan.baselines.get("data-parallel"), "megatron_baseline_cost": plan.baselines.get("megatron"),
            "memory_limit_gb": H200_GB}


def _dense_case(p: int, seed: int) -> dict[str, Any]:
    """The whole planner on a random dense 40-op DAG (planner.builders.dense_dag_graph), no limit."""
    from parashift.planner.builders import dense_dag_graph
    from parashift.planner.profile import profile_graph
    from parashift.planner.search import plan_model

    g = dense_dag_graph(40, fan_in=8, seed=seed)
    prof = profile_graph(g, "cuda")
    base_mb = _rss_mb()
    t0 = time.perf_counter()
    plan = plan_model(prof, p)
    search_s = time.perf_counter() - t0
    return {"graph": g.name, "ops": len(g.ops), "devices": p, "search_s": round(search_s, 3), "peak_mb": round(_rss_mb(), 1),
            "base_mb": round(base_mb, 1), "cost": plan.estimated_step_s, "mesh": plan.mesh,
            "proven_optimal": plan.proven_optimal, "lower_bound": plan.lower_bound_s,
            "dp_baseline_cost": plan.baselines.get("data-parallel"), "megatron_baseline_cost": plan.baselines.get("megatron")}


def _child(kind: str, p: int, queue: mp.Queue) -> None:
    if kind.startswith("dense"):
        queue.put(_dense_case(p, int(kind[5:])))
    elif kind == "gpt3":
        queue.put(_gpt3_case(p))
    elif kind == "chain":
        queue.put(_chain_case(p))
    elif kind == "chain-wide":
        queue.put(_chain_case(p, d_model=1024))
    else:
        queue.put(_pase_case(p, kind))


def run_case(kind: str, p: int) -> dict[str, Any]:
    """One case in a forked process (its own peak RSS)."""
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(kind, p, queue))
    proc.start()
    out = queue.get()
    proc.join()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="PaSE p=4,8 and GPT-3 p=8 only")
    parser.add_argument("--only", choices=("pase", "gpt3", "stress", "dense"), help="one family of cases")
    args = parser.parse_args()
    cases = [("pase", p) for p in (PASE_P[:2] if args.quick else PASE_P)]
    cases += [("gpt3", p) for p in (GPT3_P[:1] if args.quick else GPT3_P)]
    if not args.quick:
        cases += [("skip50", 64), ("skip5000", 64), ("chain", 64), ("chain", 512), ("chain-wide", 64)]
        cases += [(f"dense{seed}", p) for p in (8, 64) for seed in range(3)]
    if args.only:
        family = {"stress": ("skip", "chain")}.get(args.only, (args.only,))
        cases = [c for c in cases if c[0].startswith(family)]
    results = []
    for kind, p in cases:
        row = run_case(kind, p)
        print(f"{row['graph']:>17} p={p:<5} ops={row['ops']:<4} search {row['search_s']:>7.2f} s  "
              f"peak {row['peak_mb']:>7.1f} MB  cost {row['cost']:.4g} s  "
              f"(dp {row['dp_baseline_cost']}, megatron {row['megatron_baseline_cost']})", flush=True)
        results.append(row)
    print(json.dumps({"machine": f"{platform.machine()} {mp.cpu_count()} cores", "cases": results}))


if __name__ == "__main__":
    main()
