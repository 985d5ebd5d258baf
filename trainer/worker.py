"""The program torchrun starts on every device. Reads top to bottom: config -> distributed ->
data -> model -> restore -> loop. Data parallel over all ranks, with the global batch fixed by
the spec: each rank takes a contiguous share of every global batch and accumulates micro-batches,
and gradients are scaled so that their all-reduced mean is the global-batch mean on any device
count.

    torchrun --standalone --nproc-per-node N -m trainer.worker --spec spec.json --plan plan.json
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from planner.plan import Plan
from specs import JobSpec
from storage import CheckpointStore, JobPaths, ObjectStore
from trainer import metrics
from trainer.checkpoint import apply_state, collect_state, restore_latest, save_checkpoint, state_layout
from trainer.control import StopRequests
from trainer.data import DataPosition, SampleStream, load_tokens, micro_batches, rank_share
from trainer.model import GPT, GPTConfig, flops_per_token, token_loss_sum
from trainer.schedule import learning_rate

log = logging.getLogger("parashift.worker")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spec", type=Path, required=True, help="the validated JobSpec as JSON")
    parser.add_argument("--plan", type=Path, required=True, help="the Plan as JSON")
    parser.add_argument("--until-step", type=int, default=None, help="checkpoint and stop at this step")
    return parser.parse_args(argv)


def init_distributed(kind: str) -> tuple[int, int, torch.device]:
    """Rank, world size and device from torchrun's environment (a single process without it)."""
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if kind == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world_size > 1:
        dist.init_process_group(backend="nccl" if kind == "cuda" else "gloo", device_id=device if kind == "cuda" else None)
    return rank, world_size, device


def build_optimizer(model: torch.nn.Module, spec: JobSpec, device: torch.device) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (nanoGPT's split: not on biases, norms)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = spec.optimizer
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": opt.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=opt.lr,
        betas=tuple(opt.betas),
        eps=opt.eps,
        fused=device.type == "cuda",
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    spec = JobSpec.model_validate_json(args.spec.read_text())
    plan = Plan.model_validate_json(args.plan.read_text())
    if not plan.is_pure_data_parallel:
        raise SystemExit(f"this trainer executes data-parallel plans; got mesh {plan.mesh}")
    train = spec.training
    end_step = min(train.steps, args.until_step or train.steps)

    # distributed
    rank, world_size, device = init_distributed(spec.resources.kind)
    if world_size != plan.devices:
        raise SystemExit(f"plan is for {plan.devices} devices, torchrun started {world_size}")

    # data: every rank builds the same global sample stream
    stream = SampleStream(load_tokens(spec.data), spec.model.seq_len, train.seed)
    share_offset, share_count = rank_share(train.global_batch, world_size, rank)
    micros = micro_batches(share_count, train.micro_batch)

    # model: the same seed on every rank gives the same initial weights
    torch.manual_seed(train.seed)
    config = GPTConfig(**{name: getattr(spec.model, name) for name in GPTConfig.__dataclass_fields__})
    model = GPT(config).to(device)
    optimizer = build_optimizer(model, spec, device)
    torch.manual_seed(train.seed + 1 + rank)  # per-rank stream for dropout

    # restore
    store = ObjectStore(spec.storage.url, dict(spec.storage.storage_options))
    checkpoints = CheckpointStore(store, spec.job_id)
    restored = restore_latest(checkpoints, rank, world_size)
    step, position, loss = 0, DataPosition(), None
    if restored is not None:
        loss = restored.manifest.metadata.get("loss") if restored.manifest else None
        apply_state(restored, model, optimizer, rank, device)
        step, position = restored.step, DataPosition(restored.data_position["samples_consumed"])
    ddp_model = DistributedDataParallel(model) if world_size > 1 else model
    if spec.parallelism.compile:
        ddp_model = torch.compile(ddp_model)
    stops = StopRequests(store, spec.job_id)
    tokens_per_step = train.global_batch * spec.model.seq_len
    if rank == 0:
        metrics.emit(
            "start",
            step=step,
            resumed=restored is not None,
            checkpoint_loss=loss,
            checkpoint_url=store.url_for(JobPaths(spec.job_id).manifest(step)) if restored is not None else None,
            world_size=world_size,
            params=model.num_params(),
            flops_per_token=flops_per_token(config, model.num_params()),
            end_step=end_step,
        )

    def checkpoint(at_step: int) -> None:
        state = collect_state(model, optimizer, rank, device)
        url = save_checkpoint(
            checkpoints,
            at_step,
            state,
            state_layout(state, world_size),
            rank,
            world_size,
            position.to_dict(stream.samples_per_epoch),
            plan.model_dump(mode="json"),
            {"model": spec.model.model_dump(), "job": spec.name, "loss": loss},
            train.keep_checkpoints,
        )
        if rank == 0:
            metrics.emit("checkpoint", step=at_step, url=url)

    autocast = (
        torch.autocast(device.type, dtype=torch.bfloat16)
        if spec.parallelism.precision == "bf16"
        else contextlib.nullcontext()
    )
    # Each rank's gradient is scaled by world_size / global tokens: DDP's mean over ranks then
    # yields the mean over every token of the global batch, whatever the share sizes.
    loss_scale = world_size / tokens_per_step
    stopped = False
    while step < end_step:
        started = time.perf_counter()
        lr = learning_rate(step, train.steps, spec.optimizer)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss_sum = torch.zeros((), device=device)
        for i, (offset, size) in enumerate(micros):
            inputs, targets = stream.batch(position.samples_consumed + share_offset + offset, size)
            inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
            last = i == len(micros) - 1
            sync = contextlib.nullcontext() if last or world_size == 1 else ddp_model.no_sync()
            with sync:
                with autocast:
                    micro_loss = token_loss_sum(ddp_model(inputs), targets)  # scalar, sum over tokens
                (micro_loss * loss_scale).backward()
            loss_sum += micro_loss.detach().float()
        if spec.optimizer.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), spec.optimizer.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        position = DataPosition(position.samples_consumed + train.global_batch)

        # one small all-reduce: the global loss and whether any rank was asked to stop
        report = torch.stack([loss_sum, torch.tensor(float(stops.requested()), device=device)])
        if world_size > 1:
            dist.all_reduce(report)
        loss, stop_now = report[0].item() / tokens_per_step, report[1].item() > 0
        elapsed = time.perf_counter() - started
        if rank == 0 and (step % train.log_every == 0 or step == end_step):
            metrics.emit("step", step=step, loss=loss, lr=lr, step_s=elapsed, tokens_per_s=tokens_per_step / elapsed)
        if step % train.checkpoint_every == 0 or step == end_step or stop_now:
            checkpoint(step)
        if stop_now and step < end_step:
            stopped = True
            break

    if rank == 0:
        metrics.emit("stopped" if stopped else "finished", step=step, samples_consumed=position.samples_consumed)
    if world_size > 1:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
