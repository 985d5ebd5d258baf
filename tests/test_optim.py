"""LocalShardAdamW is torch's AdamW (same groups, same numbers) and its state round-trips by name."""

from __future__ import annotations

import torch
from parashift.models.gpt.model import GPT, GPTConfig
from parashift.specs import JobSpec
from parashift.trainer.optim import LocalShardAdamW

SPEC = JobSpec.model_validate({"name": "optim", "model": {"n_layers": 2, "d_model": 32, "n_heads": 2, "vocab_size": 256, "seq_len": 16},
                               "optimizer": {"lr": 1e-2, "weight_decay": 0.1}})


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig.of(SPEC.model))


def _train(model: GPT, step: callable, steps: int, seed: int = 1) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        idx = torch.randint(0, 256, (4, 16), generator=generator)
        model(idx).square().mean().backward()
        step()


def test_steps_like_torch_adamw_with_nanogpt_decay_split() -> None:
    ours, reference = _model(), _model()
    optimizer = LocalShardAdamW(ours, SPEC, torch.device("cpu"))
    opt = SPEC.optimizer
    decay = [p for p in reference.parameters() if p.dim() >= 2]
    no_decay = [p for p in reference.parameters() if p.dim() < 2]
    torch_adamw = torch.optim.AdamW([{"params": decay, "weight_decay": opt.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                                    lr=opt.lr, betas=tuple(opt.betas), eps=opt.eps)

    def ours_step() -> None:
        optimizer.step()
        optimizer.zero_grad()

    def torch_step() -> None:
        torch_adamw.step()
        torch_adamw.zero_grad(set_to_none=True)

    _train(ours, ours_step, 3)
    _train(reference, torch_step, 3)
    for (name, a), b in zip(ours.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(a, b), name
        assert a.grad is None


def test_state_round_trips_by_parameter_name() -> None:
    model = _model()
    optimizer = LocalShardAdamW(model, SPEC, torch.device("cpu"))
    _train(model, lambda: (optimizer.step(), optimizer.zero_grad()), 2)
    saved = {k: v.clone() for k, v in optimizer.state_tensors().items()}
    names = {name for name, _ in model.named_parameters()}
    assert {k.rsplit("/", 1)[0] for k in saved} == names
    assert {k.rsplit("/", 1)[1] for k in saved} == {"step", "exp_avg", "exp_avg_sq"}

    restored_model = _model()
    restored_model.load_state_dict(model.state_dict())
    restored = LocalShardAdamW(restored_model, SPEC, torch.device("cpu"))
    restored.load_state_tensors(saved)
    _train(model, lambda: (optimizer.step(), optimizer.zero_grad()), 2, seed=2)
    _train(restored_model, lambda: (restored.step(), restored.zero_grad()), 2, seed=2)
    for (name, a), b in zip(model.named_parameters(), restored_model.parameters(), strict=True):
        assert torch.equal(a, b), name
