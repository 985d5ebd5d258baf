"""Stop-and-restart as a torchtitan user does it: one torchrun job per device count, the model
under FSDP2 (`fully_shard` per decoder layer and at the root), a DCP checkpoint
(`torch.distributed.checkpoint`) every `--checkpoint-every` steps and at a planned stop, and a
restart on the new count that loads it with DCP's reshard-on-load. The baseline of
bench/trace.py. Started by torchrun.

Same model, optimizer, schedule and sample order as the trainer (trainer.data's global order
and rank shares), so its step times compare; step events in the trainer's format.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from parashift.models import family_of
from parashift.models.layers import token_loss_sum
from parashift.specs import JobSpec
from parashift.trainer import metrics
from parashift.trainer.data import SampleStream, rank_share, token_source
from parashift.trainer.events import StartEvent, StepEvent
from parashift.trainer.schedule import learning_rate
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard


def latest(folder: Path) -> int | None:
    done = [int(p.name) for p in folder.glob("*") if (p / "step.json").exists()]
    return max(done, default=None)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", type=Path, required=True)
    parser.add_argument("--ckpt", type=Path, required=True)
    parser.add_argument("--until-step", type=int, required=True)
    parser.add_argument("--checkpoint-every", type=int, default=6)
    args = parser.parse_args()
    started_at = time.time()
    spec = JobSpec.model_validate_json(args.spec.read_text())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    torch.manual_seed(spec.training.seed)
    m, train = spec.model, spec.training
    family = family_of(m)
    model = family.build(m)
    for _, layer in family.layers(model):
        fully_shard(layer)
    fully_shard(model)
    opt = spec.optimizer
    optimizer = torch.optim.AdamW(model.parameters(), lr=opt.lr, betas=tuple(opt.betas), eps=opt.eps,
                                  weight_decay=opt.weight_decay)
    step = 0
    resume = latest(args.ckpt)
    restore_s = 0.0
    if resume is not None:
        loading = time.perf_counter()
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=str(args.ckpt / f"{resume:08d}"))  # resharded onto this world size
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        step = json.loads((args.ckpt / f"{resume:08d}" / "step.json").read_text())["step"]
        restore_s = time.perf_counter() - loading
    stream = SampleStream(token_source(spec.data), m.seq_len, train.seed)
    offset, count = rank_share(train.global_batch, world, rank)
    tokens_per_step = train.global_batch * m.seq_len
    if rank == 0:
        metrics.emit(StartEvent(step=step, world_size=world, resumed=resume is not None, restore_s=restore_s,
                                phases={"boot_s": round(time.time() - started_at, 3)}))
    while step < args.until_step:
        began = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, train.steps, opt)
        inputs, targets = stream.batch(step * train.global_batch + offset, count)
        loss = token_loss_sum(family.logits(model, inputs), targets)
        (loss * world / tokens_per_step).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), opt.grad_clip or float("inf"))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        report = loss.detach().clone()
        dist.all_reduce(report)
        step += 1
        if rank == 0:
            elapsed = time.perf_counter() - began
            metrics.emit(StepEvent(step=step, loss=report.item() / tokens_per_step, step_s=elapsed,
                                   tokens_per_s=tokens_per_step / elapsed))
        if step % args.checkpoint_every == 0 or step == args.until_step:
            model_state, optim_state = get_state_dict(model, optimizer)
            target = args.ckpt / f"{step:08d}"
            dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(target))
            dist.barrier()
            if rank == 0:
                (target / "step.json").write_text(json.dumps({"step": step}))  # the commit
            dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
