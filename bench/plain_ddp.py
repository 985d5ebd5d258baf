"""The baseline: a plain PyTorch DDP training loop of the same model (any family's single-device
module), batch and optimizer as the trainer, with nothing of parashift's around it (no sample
order, no stop checks, no loss all-reduce, no checkpoints). With --fsdp: FSDP2's `fully_shard`
per decoder layer and at the root instead of DDP (torchtitan's order). Started by torchrun from
bench/train_throughput.py.

Reports per-step timings in the trainer's event format so one parser reads both.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from parashift.models import family_of
from parashift.specs import JobSpec
from parashift.trainer import metrics
from parashift.trainer.data import load_tokens
from parashift.trainer.events import StepEvent
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", type=Path, required=True)
    parser.add_argument("--fsdp", action="store_true", help="FSDP2 fully_shard instead of DDP")
    args = parser.parse_args()
    spec = JobSpec.model_validate_json(args.spec.read_text())
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    torch.manual_seed(spec.training.seed)
    m = spec.model
    family = family_of(m)
    model = family.build(m)
    if args.fsdp and world > 1:
        from torch.distributed.fsdp import fully_shard

        for _, layer in family.layers(model):
            fully_shard(layer)
        ddp = fully_shard(model, reshard_after_forward=False)
    else:
        ddp = DistributedDataParallel(model) if world > 1 else model
    opt = spec.optimizer
    optimizer = torch.optim.AdamW(model.parameters(), lr=opt.lr, betas=tuple(opt.betas), eps=opt.eps, weight_decay=opt.weight_decay)
    tokens = torch.from_numpy(load_tokens(spec.data).astype("int64"))
    per_rank = spec.training.global_batch // world
    generator = torch.Generator().manual_seed(rank)
    for step in range(1, spec.training.steps + 1):
        started = time.perf_counter()
        starts = torch.randint(0, len(tokens) - m.seq_len - 1, (per_rank,), generator=generator)
        batch = torch.stack([tokens[s : s + m.seq_len + 1] for s in starts.tolist()])  # (b, T + 1)
        logits = family.logits(ddp, batch[:, :-1])  # (b, T, vocab)
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), opt.grad_clip or float("inf"))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - started
        if rank == 0:
            tokens_per_step = spec.training.global_batch * m.seq_len
            metrics.emit(StepEvent(step=step, loss=loss.item(), step_s=elapsed, tokens_per_s=tokens_per_step / elapsed))
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
