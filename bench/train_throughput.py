"""Trainer tokens/s against a plain PyTorch equivalent of each parallel mode, same model, batch
and process count:

- ddp: the trainer's data-parallel plan vs a plain DDP loop (bench/plain_ddp.py);
- tp: the trainer executing a Megatron plan (attention and MLP split over "tp", in the planner's
  per-op format, through DTensor) vs hand-written Megatron TP (bench/plain_tp.py);
- fsdp: the trainer's FSDP plan vs a plain FSDP2 loop (bench/plain_ddp.py --fsdp: fully_shard
  per decoder layer and at the root).

`--family` picks the model: the GPT, the Llama family (the same size, grouped-query attention)
or the `hf` family (transformers' Llama of the same size: dp and fsdp only).

Both run as real torchrun jobs, alternating (trainer, plain, trainer, plain, ...) so machine
noise hits both alike; each round's figure is the median step time after warm-up, and the
headline ratio is the median of the per-round (paired) ratios, which cancels the slow drifts
of a shared machine better than a ratio of medians (both are printed). Last line of output: one
JSON object with `modes: {mode: {ratio_vs_plain, ...}}` and ddp's ratio at the top level.

    OMP_NUM_THREADS=1 python -m bench.train_throughput [--family gpt] [--devices 2] [--rounds 5] [--steps 20] [--modes ddp,tp]
        [--ac selective,full]   # also each activation checkpointing mode's step cost against none, same rounds
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
from pathlib import Path

from parashift.launcher.launch import launch_workers, torchrun_command, worker_env
from parashift.specs import JobSpec
from parashift.specs.plan import Plan, TensorParallel
from parashift.trainer.events import StepEvent, WorkerEvent, parse

WARMUP_STEPS = 3  # the first steps pay for allocator growth and gradient bucket building


N_LAYERS = 6


def megatron_plan(devices: int) -> Plan:
    """Attention and MLP of every layer split over "tp" (heads, ffn), the rest replicated: the
    split bench/plain_tp.py writes by hand."""
    layers = tuple(range(N_LAYERS))
    return Plan(devices=devices, mesh={"tp": devices}, tensor_parallel=TensorParallel(attention=layers, mlp=layers),
                strategy="megatron")


# mode -> (the trainer's plan, the plain program and its arguments, whether each rank takes a share of the batch)
MODES = {
    "ddp": (Plan.data_parallel, ("parashift.bench.plain_ddp",), True),
    "tp": (megatron_plan, ("parashift.bench.plain_tp",), False),
    "fsdp": (Plan.fully_sharded, ("parashift.bench.plain_ddp", "--fsdp"), True),
}

# The reference size measured before (6 layers, d 256, T 128), in each family's terms.
MODELS = {
    "gpt": {"n_layers": N_LAYERS, "d_model": 256, "n_heads": 8, "vocab_size": 256, "seq_len": 128},
    "llama": {"family": "llama", "n_layers": N_LAYERS, "d_model": 256, "n_heads": 8, "n_kv_heads": 4, "ffn_dim": 704,
              "vocab_size": 256, "seq_len": 128},
    "hf": {"family": "hf", "seq_len": 128, "config": {
        "model_type": "llama", "num_hidden_layers": N_LAYERS, "hidden_size": 256, "num_attention_heads": 8,
        "num_key_value_heads": 4, "intermediate_size": 704, "vocab_size": 256}},
}


def bench_spec(devices: int, steps: int, store: str, split_batch: bool = True, family: str = "gpt") -> JobSpec:
    """The reference size measured before: 6 layers, d 256, T 128, global batch 16 (one micro-batch per
    rank: a share of the batch under data parallelism, all of it under tensor parallelism)."""
    return JobSpec.model_validate(
        {
            "name": "bench-throughput",
            "model": MODELS[family],
            "data": {"url": "builtin://python-stdlib", "max_bytes": 2_000_000},
            "training": {"global_batch": 16, "micro_batch": 16 // devices if split_batch else 16, "steps": steps, "checkpoint_every": 10_000},
            "resources": {"devices": devices, "kind": "cpu"},
            "storage": {"url": store},
        }
    )


def median_rate(events: list[WorkerEvent]) -> float:
    rates = [e.tokens_per_s for e in events if isinstance(e, StepEvent)][WARMUP_STEPS:]
    return statistics.median(rates)


def run_trainer(spec: JobSpec, plan: Plan, round_index: int, variant: str = "") -> float:
    """The trainer's median tokens/s, as a job of its own (a name per round and variant: never a resume)."""
    spec = spec.model_copy(update={"name": f"bench-throughput-{round_index}{variant}"})
    result = launch_workers(spec, plan)
    if result.returncode != 0:
        raise RuntimeError(f"trainer run failed with {result.returncode}")
    return median_rate(result.events)


def run_plain(spec: JobSpec, program: tuple[str, ...], devices: int, tmp: Path) -> float:
    spec_file = tmp / "plain-spec.json"
    spec_file.write_text(spec.model_dump_json())
    command = torchrun_command(devices, program[0], "--spec", str(spec_file), *program[1:], log_dir=tmp / "torchrun")
    done = subprocess.run(command, capture_output=True, text=True, env=worker_env("cpu"), check=True)
    return median_rate([e for line in done.stdout.splitlines() if (e := parse(line))])


def bench_mode(mode: str, devices: int, rounds_n: int, steps: int, tmp: Path, family: str = "gpt",
               ac_modes: tuple[str, ...] = ()) -> dict:
    """Trainer against plain, round by round; `ac_modes`: in each round also the trainer with
    that activation checkpointing (its step cost against the trainer without, paired per round)."""
    make_plan, program, split_batch = MODES[mode]
    spec = bench_spec(devices, steps, f"file://{tmp}/store-{mode}", split_batch, family)
    rounds = []
    for i in range(rounds_n):
        trainer = run_trainer(spec, make_plan(devices), i)
        plain = run_plain(spec, program, devices, tmp)
        row = {"trainer_tokens_per_s": trainer, "plain_tokens_per_s": plain, "ratio": trainer / plain}
        for ac in ac_modes:
            checkpointed = run_trainer(spec, make_plan(devices).model_copy(update={"activation_checkpointing": ac}), i,
                                       f"-{ac}")
            row[f"{ac}_tokens_per_s"] = checkpointed
            row[f"{ac}_step_cost"] = trainer / checkpointed  # a step with it / a step without
        rounds.append(row)
        print(f"{mode} round {i}: " + ", ".join(f"{k} {v:,.3f}" for k, v in row.items()), flush=True)
    trainer_median = statistics.median(r["trainer_tokens_per_s"] for r in rounds)
    plain_median = statistics.median(r["plain_tokens_per_s"] for r in rounds)
    checkpointing = {ac: {"step_cost_vs_none": round(statistics.median(r[f"{ac}_step_cost"] for r in rounds), 4),
                          "tokens_per_s": round(statistics.median(r[f"{ac}_tokens_per_s"] for r in rounds), 1)}
                     for ac in ac_modes}
    return {
        "activation_checkpointing": checkpointing,
        "devices": devices,
        "plain": " ".join(program),
        "trainer_tokens_per_s": round(trainer_median, 1),
        "plain_tokens_per_s": round(plain_median, 1),
        "ratio_vs_plain": round(statistics.median(r["ratio"] for r in rounds), 4),
        "ratio_of_medians": round(trainer_median / plain_median, 4),
        "rounds": rounds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--modes", default="ddp,tp", help=f"comma-separated, from {sorted(MODES)}")
    parser.add_argument("--family", default="gpt", choices=sorted(MODELS))
    parser.add_argument("--ac", default="", help="comma-separated activation checkpointing modes to time beside "
                                                  "the trainer without (selective, full)")
    args = parser.parse_args()
    ac_modes = tuple(m for m in args.ac.split(",") if m)
    modes = {}
    with tempfile.TemporaryDirectory(prefix="parashift-bench-") as tmp:
        for mode in args.modes.split(","):
            modes[mode] = bench_mode(mode, args.devices, args.rounds, args.steps, Path(tmp), args.family, ac_modes)
    headline = modes["ddp"]["ratio_vs_plain"] if "ddp" in modes else None
    print(json.dumps({"benchmark": "train_throughput", "family": args.family, "ratio_vs_plain": headline,
                      "modes": modes}))


if __name__ == "__main__":
    main()
