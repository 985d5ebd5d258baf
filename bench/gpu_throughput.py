"""One prepared device check: GPT-2 124M (12 layers, d 768, batch 16 x 1024, bf16, compiled) on
one GPU through the trainer (a real torchrun worker) and through a plain PyTorch loop of the
same model, in the same call. Reports tokens/s and MFU against the dense bf16 peak.

    python -m bench.gpu_throughput                       # on the GPU machine
    python -m bench.gpu_throughput --device cpu --tiny   # a smoke run of the same code on CPU

Last line: one JSON object with `ratio_vs_plain`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F
from parashift.launcher.launch import launch_workers
from parashift.models.gpt.family import FAMILY
from parashift.models.gpt.model import GPT, GPTConfig
from parashift.specs import JobSpec, example_path, load_spec
from parashift.specs.plan import Plan

H200_BF16_DENSE_FLOPS = 989e12  # NVIDIA H200 SXM datasheet, dense BF16 tensor core peak
WARMUP_STEPS = 10  # compilation and autotuning happen in the first steps


def job_spec(device: str, tiny: bool, steps: int, store: str) -> JobSpec:
    spec = load_spec(example_path("gpt2-small-cuda"))
    update: dict = {
        "resources": spec.resources.model_copy(update={"kind": device}),
        "training": spec.training.model_copy(update={"steps": steps, "checkpoint_every": 10_000}),
        "storage": spec.storage.model_copy(update={"url": store}),
    }
    if tiny:
        update["model"] = spec.model.model_copy(update={"n_layers": 2, "d_model": 64, "n_heads": 4, "seq_len": 64})
        update["parallelism"] = spec.parallelism.model_copy(update={"compile": False, "precision": "fp32"})
    return spec.model_copy(update=update)


def plain_loop(spec: JobSpec, device: str) -> list[float]:
    """The reference: the same model, batch, optimizer settings, autocast and compile, no parashift."""
    m, train, opt = spec.model, spec.training, spec.optimizer
    torch.manual_seed(train.seed)
    dev = torch.device(device)
    model = GPT(GPTConfig.of(m)).to(dev)
    optimizer = torch.optim.AdamW(model.parameters(), lr=opt.lr, betas=tuple(opt.betas), weight_decay=opt.weight_decay, fused=dev.type == "cuda")
    step_fn = torch.compile(model) if spec.parallelism.compile else model
    bf16 = spec.parallelism.precision == "bf16"
    tokens = torch.randint(0, 256, (train.global_batch, m.seq_len + 1), device=dev)  # (B, T + 1)
    rates = []
    for _ in range(train.steps):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
            logits = step_fn(tokens[:, :-1])  # (B, T, vocab)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), opt.grad_clip or float("inf"))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()  # the trainer reads its loss every step too
        rates.append(train.global_batch * m.seq_len / (time.perf_counter() - started))
    return rates[WARMUP_STEPS:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model: checks the script, not the GPU")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--peak-flops", type=float, default=H200_BF16_DENSE_FLOPS)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="parashift-gpu-") as tmp:
        spec = job_spec(args.device, args.tiny, args.steps, f"file://{tmp}/store")
        result = launch_workers(spec, Plan.data_parallel(1), on_line=lambda line: print(line, flush=True))
        if result.returncode != 0:
            raise SystemExit(f"trainer failed with {result.returncode}")
        trainer_rates = [e.tokens_per_s for e in result.steps][WARMUP_STEPS:]
        plain_rates = plain_loop(spec, args.device)
    m = spec.model
    config = GPTConfig.of(m)
    params = GPT(config).num_params()
    per_token = FAMILY.flops_per_token(m, params)
    trainer, plain = statistics.median(trainer_rates), statistics.median(plain_rates)
    report = {
        "benchmark": "gpu_throughput",
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "params": params,
        "trainer_tokens_per_s": round(trainer),
        "plain_tokens_per_s": round(plain),
        "trainer_mfu": round(trainer * per_token / args.peak_flops, 4),
        "plain_mfu": round(plain * per_token / args.peak_flops, 4),
        "ratio_vs_plain": round(trainer / plain, 4),
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
