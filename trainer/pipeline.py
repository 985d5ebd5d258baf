"""Pipeline parallelism with `torch.distributed.pipelining`: the GPT cut into stages of whole
layers (the Plan's stages), micro-batches = plan.micro_batches, a GPipe or 1F1B schedule.

A stage module holds the original modules under their original names (`blocks.<i>...`), so
checkpoints name parameters the same under every plan.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from specs.plan import Plan
from trainer.model import GPT

# Names of torch.distributed.pipelining's schedules. The package is imported only by a pipeline
# stage: it pulls in torch._dynamo (0.85 s per process here), which every worker of a plan without
# pp would otherwise pay at each (re)launch.
SCHEDULES = ("1F1B", "GPipe")
# The planner costs pipelines as 1F1B (planner/pipeline.py), so that is the default.
DEFAULT_SCHEDULE = "1F1B"

class GPTStage(nn.Module):
    """Some consecutive layers of a GPT; the first stage also embeds, the last also projects."""

    def __init__(self, model: GPT, layers: list[int], first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        self.tok_emb = model.tok_emb if first else None
        self.pos_emb = model.pos_emb if first else None
        self.drop = model.drop if first else None
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in layers})
        self.norm = model.norm if last else None
        self.lm_head = model.lm_head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            T = x.shape[1]  # x: (B, T) token ids
            pos = torch.arange(T, device=x.device)  # (T,)
            x = self.drop(self.tok_emb(x) + self.pos_emb(pos))  # (B, T, d)
        for block in self.blocks.values():
            x = block(x)  # (B, T, d), or (B, T/tp, d) under sequence parallelism
        if self.last:
            x = self.lm_head(self.norm(x))  # (B, T, vocab)
        return x


def build_stage(model: GPT, plan: Plan, pp_rank: int) -> GPTStage:
    layers = plan.layers_per_stage(len(model.blocks))
    return GPTStage(model, layers[pp_rank], first=pp_rank == 0, last=pp_rank == len(layers) - 1)


class PipelineRunner:
    """One training step of this rank's stage under a schedule; reports the unscaled loss sum."""

    def __init__(
        self,
        module: nn.Module,
        pp_mesh: DeviceMesh,
        device: torch.device,
        micro_batches: int,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        loss_scale: float,
        schedule: str = DEFAULT_SCHEDULE,
    ) -> None:
        self.rank, self.stages = pp_mesh.get_local_rank(), pp_mesh.size()
        self.first, self.last = self.rank == 0, self.rank == self.stages - 1
        self.loss_scale = loss_scale
        from torch.distributed import pipelining

        if schedule not in SCHEDULES:
            raise ValueError(f"unknown pipeline schedule {schedule!r}; choose from {SCHEDULES}")
        stage = pipelining.PipelineStage(module, self.rank, self.stages, device, group=pp_mesh.get_group())

        def scaled_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return loss_fn(output, target) * loss_scale  # loss_fn: scalar, sum over the micro-batch's tokens

        # scale_grads=False: the loss is already scaled to the global-token mean.
        schedule_class = getattr(pipelining, f"Schedule{schedule}")
        self.schedule = schedule_class(stage, micro_batches, loss_fn=scaled_loss, scale_grads=False)

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward and backward of every micro-batch; the loss sum (0 off the last stage)."""
        # The schedule's own per-micro-batch losses: loss_fn also runs once more on the first
        # step (shape inference), on uninitialised data.
        losses: list[torch.Tensor] = []
        if self.first:
            self.schedule.step(inputs, target=targets if self.last else None, losses=losses)
        elif self.last:
            self.schedule.step(target=targets, losses=losses)
        else:
            self.schedule.step()
        if not losses:
            return torch.zeros((), device=inputs.device)
        return torch.stack([loss.detach().float() for loss in losses]).sum() / self.loss_scale
