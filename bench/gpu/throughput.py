"""Part 1 of the GPU check, throughput: the trainer (a real torchrun worker) against a plain
PyTorch loop of the same model, batch, optimizer, precision and compilation, in the same call.

- `llama-1b`: the Llama 3.2 1B shape (`specs/llama3-1b-cuda.yaml`), bf16 autocast, each layer
  compiled (torchtitan's way, in both), no activation checkpointing.
- `llama-1b-selective`: the same trainer with selective activation checkpointing (its cost in
  tokens/s against the plain loop without it).
- `hf-llama-1b`: the `hf` family, a `transformers` LlamaForCausalLM of that shape (eager, sdpa),
  against the same `transformers` model in a plain loop. On one rank the trainer applies no FSDP
  (a data axis of 1), so both loops hold the whole model.

Each line: tokens/s of both (medians after the warm-up steps), MFU against the dense bf16 peak,
and `ratio_vs_plain` (trainer / plain).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from parashift.bench.gpu.common import H200_BF16_DENSE_FLOPS, case, device_name, free_cuda, part_args, synced
from parashift.launcher.launch import launch_workers
from parashift.models import family_of
from parashift.models.llama.hf import hf_config
from parashift.specs import JobSpec, example_path, load_spec
from parashift.specs.plan import Plan

PART = "throughput"
WARMUP_STEPS = 8  # compilation and autotuning happen in the first steps
TINY_LLAMA = {"n_layers": 2, "d_model": 64, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 128, "vocab_size": 512,
              "seq_len": 64}


def llama_spec(device: str, tiny: bool, steps: int, store: str, ac: str = "none") -> JobSpec:
    spec = load_spec(example_path("llama3-1b-cuda"))
    update: dict[str, Any] = {
        "name": f"gpu-throughput-{ac}",
        "resources": spec.resources.model_copy(update={"kind": device}),
        "training": spec.training.model_copy(update={"steps": steps, "checkpoint_every": 10_000}),
        "storage": spec.storage.model_copy(update={"url": store}),
        "parallelism": spec.parallelism.model_copy(update={"activation_checkpointing": ac}),
    }
    if tiny:
        update["model"] = spec.model.model_copy(update=TINY_LLAMA)
        update["training"] = update["training"].model_copy(update={"global_batch": 4, "micro_batch": 4})
        update["parallelism"] = update["parallelism"].model_copy(update={"compile": False, "precision": "fp32"})
    return spec.model_copy(update=update)


def hf_spec(llama: JobSpec) -> JobSpec:
    """The same shape as the `hf` family: transformers' LlamaForCausalLM from a config (eager)."""
    config = {"model_type": "llama", **hf_config(llama.model)}
    config.pop("architectures", None)
    config.pop("torch_dtype", None)
    config.pop("dtype", None)
    model = {"family": "hf", "seq_len": llama.model.seq_len, "config": config}
    parallelism = llama.parallelism.model_copy(update={"compile": False, "activation_checkpointing": "none"})
    return JobSpec.model_validate({**llama.model_dump(exclude={"model", "parallelism"}), "name": "gpu-throughput-hf",
                                   "model": model, "parallelism": parallelism.model_dump()})


def trainer_rates(spec: JobSpec, warmup: int) -> list[float]:
    """Tokens/s of each step after the warm-up, as the trainer's workers report them."""
    result = launch_workers(spec, Plan.data_parallel(1), on_line=lambda line: print(line, file=sys.stderr, flush=True))
    if result.returncode != 0:
        raise RuntimeError(f"the trainer failed with {result.returncode}")
    return [e.tokens_per_s for e in result.steps][warmup:]


def plain_rates(spec: JobSpec, device: torch.device, model: torch.nn.Module, forward: Callable[[Any], torch.Tensor],
                layers: list[torch.nn.Module], warmup: int) -> list[float]:
    """The reference loop: autocast, per-layer compile where the spec compiles, fused AdamW,
    gradient clipping, the loss read every step (as the trainer does)."""
    train, opt = spec.training, spec.optimizer
    if spec.parallelism.compile:
        for layer in layers:
            layer.compile()
    optimizer = torch.optim.AdamW(model.parameters(), lr=opt.lr, betas=tuple(opt.betas), weight_decay=opt.weight_decay,
                                  fused=device.type == "cuda")
    bf16 = spec.parallelism.precision == "bf16"
    seq = spec.model.seq_len
    tokens = torch.randint(0, 256, (train.global_batch, seq + 1), device=device)  # (B, T + 1)
    rates = []
    for _ in range(train.steps):
        synced(device)
        started = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = forward(tokens[:, :-1])  # (B, T, vocab)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), opt.grad_clip or float("inf"))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()
        rates.append(train.global_batch * seq / (time.perf_counter() - started))
    return rates[warmup:]


def plain_llama(spec: JobSpec, device: torch.device, warmup: int) -> list[float]:
    family = family_of(spec.model)
    torch.manual_seed(spec.training.seed)
    with torch.device(device):
        model = family.build(spec.model)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)  # values do not matter here; no NaNs do
    return plain_rates(spec, device, model, model, [layer for _, layer in family.layers(model)], warmup)


def plain_hf(spec: JobSpec, device: torch.device, warmup: int) -> list[float]:
    from parashift.models.hf.spec import transformers_config
    from transformers import AutoModelForCausalLM

    config = transformers_config(spec.model)
    torch.manual_seed(spec.training.seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=spec.model.attention)
    return plain_rates(spec, device, model, lambda ids: model(input_ids=ids).logits, [], warmup)


def report(fields: dict[str, Any], spec: JobSpec, params: int, trainer: list[float], plain: list[float] | None,
           peak_flops: float) -> None:
    per_token = family_of(spec.model).flops_per_token(spec.model, params)
    t = statistics.median(trainer)
    fields.update(params=params, steps_measured=len(trainer), trainer_tokens_per_s=round(t),
                  trainer_mfu=round(t * per_token / peak_flops, 4))
    if plain:
        p = statistics.median(plain)
        fields.update(plain_tokens_per_s=round(p), plain_mfu=round(p * per_token / peak_flops, 4),
                      ratio_vs_plain=round(t / p, 4))


def main() -> None:
    args = part_args(__doc__)
    device = torch.device(args.device)
    warmup = 1 if args.tiny else WARMUP_STEPS  # toy sizes compile nothing
    steps = warmup + (2 if args.tiny else 12)
    # The final checkpoint (the whole state, every run saves one) stays in the worker's memory:
    # minutes on the device go to steps, and part 3 measures saves.
    store = "memory://gpu-throughput"
    peak = H200_BF16_DENSE_FLOPS
    params = 0
    plain_none: list[float] | None = None
    with case(PART, "llama-1b") as fields:
        spec = llama_spec(args.device, args.tiny, steps, store)
        fields.update(device=device_name(device), torch=torch.__version__, seq_len=spec.model.seq_len,
                      global_batch=spec.training.global_batch, compile=spec.parallelism.compile)
        trainer = trainer_rates(spec, warmup)
        plain_none = plain_llama(spec, device, warmup)
        params = sum(p.numel() for p in family_of(spec.model).build_on_meta(spec.model).parameters())
        report(fields, spec, params, trainer, plain_none, peak)
    free_cuda()
    with case(PART, "llama-1b-selective") as fields:
        spec = llama_spec(args.device, args.tiny, steps, store, ac="selective")
        report(fields, spec, params, trainer_rates(spec, warmup), plain_none, peak)
        fields["ratio_is_against"] = "the plain loop without checkpointing"
    free_cuda()
    with case(PART, "hf-llama-1b") as fields:
        spec = hf_spec(llama_spec(args.device, args.tiny, steps, store))
        trainer = trainer_rates(spec, warmup)
        plain = plain_hf(spec, device, warmup)
        report(fields, spec, params, trainer, plain, peak)
        fields["compile"] = False


if __name__ == "__main__":
    main()
