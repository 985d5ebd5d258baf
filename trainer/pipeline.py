"""Pipeline parallelism with `torch.distributed.pipelining`: a family's model cut into stages of
whole layers (the Plan's stages), micro-batches = plan.micro_batches, a GPipe or 1F1B schedule.

A stage is the one model with the other stages' parts removed (`build_stage`, from the family's
sharding table), so its parameters keep their names under every plan and its forward is the
model's own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from parashift.models.base import ModelFamily
from parashift.specs.plan import Plan
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

# Names of torch.distributed.pipelining's schedules. The package is imported only by a pipeline
# stage: it pulls in torch._dynamo (0.85 s per process here), which every worker of a plan without
# pp would otherwise pay at each (re)launch.
SCHEDULES = ("1F1B", "GPipe")
# The planner costs pipelines as 1F1B (planner/pipeline.py), so that is the default.
DEFAULT_SCHEDULE = "1F1B"

def build_stage(model: nn.Module, family: ModelFamily, plan: Plan, n_layers: int, pp_rank: int) -> nn.Module:
    """This rank's pipeline stage: `model` itself with the other stages' layers removed, and the
    parts the family's sharding table gives the first stage (embeddings) or the last (final
    norm, head) set to None elsewhere; the model's own forward then runs the stage (after
    torchtitan's pipeline split). Parameters keep their names, so checkpoints name them the
    same under every plan."""
    table = family.sharding
    assert table is not None, f"the {family.name} family has no sharding table"
    stages = plan.layers_per_stage(n_layers)
    kept = {str(i) for i in stages[pp_rank]}
    layers = getattr(model, table.layers)
    for name in [n for n, _ in layers.named_children() if n not in kept]:
        del layers[name]
    if pp_rank > 0:
        for name in table.first_stage:
            setattr(model, name, None)
    if pp_rank < len(stages) - 1:
        for name in table.last_stage:
            setattr(model, name, None)
    return model


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
        # return_outputs=False: the last stage would otherwise keep every micro-batch's logits
        # until the step ends and concatenate them (4 GiB a micro-batch of 8192 tokens at a
        # 128k vocabulary); only the losses are read.
        return self._loss_sum(lambda *a, **k: self.schedule.step(*a, **k, return_outputs=False), inputs, targets)

    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward only, of a batch shaped as a training step's share (the stages' buffers keep
        their shapes); the loss sum (0 off the last stage)."""
        return self._loss_sum(self.schedule.eval, inputs, targets)

    def _loss_sum(self, run: Callable[..., Any], inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        losses: list[torch.Tensor] = []
        if self.first:
            run(inputs, target=targets if self.last else None, losses=losses)
        elif self.last:
            run(target=targets, losses=losses)
        else:
            run()
        if not losses:
            return torch.zeros((), device=inputs.device)
        return torch.stack([loss.detach().float() for loss in losses]).sum() / self.loss_scale
