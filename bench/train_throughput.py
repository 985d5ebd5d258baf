"""Trainer tokens/s against a plain PyTorch DDP loop of the same model, batch and process count.

Both run as real torchrun jobs, alternating (trainer, plain, trainer, plain, ...) so machine
noise hits both alike; each round's figure is the median step time after warm-up, and the
headline ratio is the median of the per-round (paired) ratios, which cancels the slow drifts
of a shared machine better than a ratio of medians (both are printed). Last line of output: one JSON object.

    OMP_NUM_THREADS=1 python -m bench.train_throughput [--devices 2] [--rounds 3] [--steps 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from planner.plan import Plan
from specs import JobSpec
from trainer import metrics
from trainer.launch import launch_workers, worker_env

WARMUP_STEPS = 3  # the first steps pay for allocator growth and DDP bucket rebuilding


def bench_spec(devices: int, steps: int, store: str) -> JobSpec:
    """FACTS.md's reference size: 6 layers, d 256, T 128, global batch 16 (one micro-batch per rank)."""
    return JobSpec.model_validate(
        {
            "name": "bench-throughput",
            "model": {"n_layers": 6, "d_model": 256, "n_heads": 8, "vocab_size": 256, "seq_len": 128},
            "data": {"url": "builtin://python-stdlib", "max_bytes": 2_000_000},
            "training": {"global_batch": 16, "micro_batch": 16 // devices, "steps": steps, "checkpoint_every": 10_000},
            "resources": {"devices": devices, "kind": "cpu"},
            "storage": {"url": store},
        }
    )


def median_rate(events: list[dict]) -> float:
    rates = [e["tokens_per_s"] for e in events if e["event"] == "step"][WARMUP_STEPS:]
    return statistics.median(rates)


def run_trainer(spec: JobSpec, devices: int, store_root: Path, round_index: int) -> float:
    spec = spec.model_copy(update={"name": f"bench-throughput-{round_index}"})
    result = launch_workers(spec, Plan.data_parallel(devices))
    if result.returncode != 0:
        raise RuntimeError(f"trainer run failed with {result.returncode}")
    return median_rate(result.events)


def run_plain(spec: JobSpec, devices: int, tmp: Path) -> float:
    spec_file = tmp / "plain-spec.json"
    spec_file.write_text(spec.model_dump_json())
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={devices}", "-m", "bench.plain_ddp", "--spec", str(spec_file)]
    done = subprocess.run(command, capture_output=True, text=True, env=worker_env("cpu"), check=True)
    return median_rate([e for line in done.stdout.splitlines() if (e := metrics.parse(line))])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    rounds = []
    with tempfile.TemporaryDirectory(prefix="parashift-bench-") as tmp:
        spec = bench_spec(args.devices, args.steps, f"file://{tmp}/store")
        for i in range(args.rounds):
            trainer = run_trainer(spec, args.devices, Path(tmp), i)
            plain = run_plain(spec, args.devices, Path(tmp))
            rounds.append({"trainer_tokens_per_s": trainer, "plain_tokens_per_s": plain, "ratio": trainer / plain})
            print(f"round {i}: trainer {trainer:,.0f} tok/s, plain DDP {plain:,.0f} tok/s, ratio {trainer / plain:.3f}", flush=True)
    trainer_median = statistics.median(r["trainer_tokens_per_s"] for r in rounds)
    plain_median = statistics.median(r["plain_tokens_per_s"] for r in rounds)
    ddp = {
        "devices": args.devices,
        "trainer_tokens_per_s": round(trainer_median, 1),
        "plain_tokens_per_s": round(plain_median, 1),
        "ratio_vs_plain": round(statistics.median(r["ratio"] for r in rounds), 4),
        "ratio_of_medians": round(trainer_median / plain_median, 4),
        "rounds": rounds,
    }
    print(json.dumps({"benchmark": "train_throughput", "ratio_vs_plain": ddp["ratio_vs_plain"], "modes": {"ddp": ddp}}))


if __name__ == "__main__":
    main()
