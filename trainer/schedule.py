"""Learning rate as a pure function of the step: nothing to checkpoint, identical after resume."""

from __future__ import annotations

import math

from parashift.specs import OptimizerSpec


def learning_rate(step: int, total_steps: int, opt: OptimizerSpec) -> float:
    """Linear warm-up to `lr`, then `schedule` down to `min_lr` at the last step."""
    if opt.warmup_steps and step < opt.warmup_steps:
        return opt.lr * (step + 1) / opt.warmup_steps
    if opt.schedule == "constant":
        return opt.lr
    span = max(1, total_steps - opt.warmup_steps)
    progress = min(1.0, (step - opt.warmup_steps) / span)
    if opt.schedule == "linear":
        return opt.lr + (opt.min_lr - opt.lr) * progress
    return opt.min_lr + 0.5 * (opt.lr - opt.min_lr) * (1 + math.cos(math.pi * progress))
