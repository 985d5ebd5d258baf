"""Activation checkpointing and FSDP2 mixed precision change memory, not the training.

- Per family and plan kind, selective and full checkpointing give the loss of the run without
  it at every one of 6 steps within 1e-6 (fp32; steps 2-6 follow updates made from recomputed
  gradients); the GPT runs with dropout, so a recomputed layer must draw the masks its forward
  drew.
- bf16 through FSDP2's policy stays within bf16 tolerance of bf16 autocast.
- A checkpoint saved under one (checkpointing, precision, plan) restores bitwise under another:
  both hold the same fp32 state.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from jobs import checkpoint_store, final_state, mesh_plan, run, tiny_spec
from parashift.models.layers import box_index
from parashift.specs import JobSpec
from parashift.specs.loader import resolve_model
from parashift.specs.plan import Plan
from parashift.trainer.checkpoint import restore_latest
from parashift.trainer.layout import state_layout
from parashift.trainer.recompute import SAVED_OPS, checkpoint_layer
from parashift.trainer.state import rng_state_bytes
from torch import nn

pytestmark = pytest.mark.slow

TRAINING = {"global_batch": 8, "micro_batch": 4, "steps": 20, "seed": 7, "checkpoint_every": 10}
GPT = {"n_layers": 2, "d_model": 48, "n_heads": 4, "vocab_size": 256, "seq_len": 24, "dropout": 0.1}
LLAMA = {"family": "llama", "n_layers": 2, "d_model": 48, "n_heads": 8, "n_kv_heads": 4, "ffn_dim": 80,
         "vocab_size": 256, "seq_len": 24}
HF = {"family": "hf", "seq_len": 24, "config": {
    "model_type": "llama", "num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
    "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": 256}}
MODELS = {"gpt": GPT, "llama": LLAMA, "hf": HF}


def job(name: str, tmp: Path, model: str, steps: int = 20, **parallelism: object) -> JobSpec:
    spec = tiny_spec(name, f"file://{tmp}/store", training={**TRAINING, "steps": steps})
    data = spec.model_dump()
    data["model"] = MODELS[model]
    data["parallelism"] = {**data["parallelism"], **parallelism}
    return resolve_model(JobSpec.model_validate(data))


def with_ac(plan: Plan, mode: str, **fields: object) -> Plan:
    return plan.model_copy(update={"activation_checkpointing": mode, **fields})


# (family, plan kind) -> the plan; every plan kind of the trainer, each family under those it runs
# (GPT's tensor parallelism within its pp 2 x tp 2 case, Llama's HSDP within GPT's and hf's: 17 s
# of the suite less).
PLANS = {
    ("gpt", "dp2"): lambda: Plan.data_parallel(2),
    ("gpt", "pp2"): lambda: mesh_plan({"pp": 2}, micro_batches=2),
    ("gpt", "fsdp2"): lambda: Plan.fully_sharded(2),
    ("gpt", "hsdp2x2"): lambda: mesh_plan({"dp": 4}, dp_shard=2),
    ("gpt", "pp2xtp2"): lambda: mesh_plan({"pp": 2, "tp": 2}, micro_batches=2),
    ("llama", "dp2"): lambda: Plan.data_parallel(2),
    ("llama", "tp2"): lambda: mesh_plan({"tp": 2}),
    ("llama", "pp2"): lambda: mesh_plan({"pp": 2}, micro_batches=2),
    ("llama", "fsdp2"): lambda: Plan.fully_sharded(2),
    ("llama", "pp2xtp2"): lambda: mesh_plan({"pp": 2, "tp": 2}, micro_batches=2),
    ("hf", "dp2"): lambda: Plan.data_parallel(2),
    ("hf", "fsdp2"): lambda: Plan.fully_sharded(2),
    ("hf", "hsdp2x2"): lambda: mesh_plan({"dp": 4}, dp_shard=2),
}


@pytest.mark.parametrize(("model", "kind"), list(PLANS), ids=[f"{m}-{k}" for m, k in PLANS])
def test_checkpointed_layers_train_exactly_as_kept_ones(model: str, kind: str, tmp_path: Path) -> None:
    losses = {}
    for mode in ("none", "selective", "full"):
        spec = job(f"{model}-{kind}-{mode}", tmp_path / mode, model, steps=6)
        losses[mode] = [e.loss for e in run(spec, with_ac(PLANS[model, kind](), mode)).steps]
    assert len(losses["none"]) == 6
    for mode in ("selective", "full"):
        for step, (got, want) in enumerate(zip(losses[mode], losses["none"], strict=True), 1):
            assert abs(got - want) <= 1e-6 * abs(want), f"{mode}, step {step}: {got} vs {want}"


def test_pipeline_stages_checkpointing_differently_train_exactly_as_without(tmp_path: Path) -> None:
    """A plan whose first stage checkpoints fully and whose second keeps everything (what the
    planner picks where only the first stage, holding the most micro-batches, is short of
    memory): each stage executes its own mode, and the losses are the run without checkpointing's."""
    plain = run(job("stages-none", tmp_path / "none", "gpt"), mesh_plan({"pp": 2}, micro_batches=2))
    mixed_plan = mesh_plan({"pp": 2}, micro_batches=2, stage_activation_checkpointing=["full", "none"])
    assert (mixed_plan.ac_of_stage(0), mixed_plan.ac_of_stage(1)) == ("full", "none")
    mixed = run(job("stages-mixed", tmp_path / "mixed", "gpt"), mixed_plan)
    want, got = [e.loss for e in plain.steps], [e.loss for e in mixed.steps]
    assert len(got) == 20
    for step, (a, b) in enumerate(zip(got, want, strict=True), 1):
        assert abs(a - b) <= 1e-6 * abs(b), f"step {step}: {a} vs {b}"
    # each stage ran its own mode: the first holds less than without checkpointing, the second the same
    from parashift.trainer.memory_probe import measure_step_peak

    spec = job("stages-probe", tmp_path / "probe", "gpt")
    peaks = {name: [measure_step_peak(spec, plan, rank=r, fake=False)["activations"] for r in (0, 1)]
             for name, plan in (("none", mesh_plan({"pp": 2}, micro_batches=2)), ("mixed", mixed_plan))}
    assert peaks["mixed"][0] < peaks["none"][0] and peaks["mixed"][1] == peaks["none"][1], peaks


def test_selective_checkpointing_keeps_matmul_outputs_and_recomputes_the_rest() -> None:
    """The policy itself, on one layer: under selective checkpointing, autograd keeps the
    layer's input and the outputs of its GEMMs, fewer bytes than without; under full, only the
    input."""
    from parashift.trainer.memory import alive_after

    torch.manual_seed(0)
    kept = {}
    for mode in ("none", "selective", "full"):
        layer = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 16), nn.LayerNorm(16))
        checkpoint_layer(layer, mode)
        x = torch.randn(4, 16, requires_grad=True)
        kept[mode] = alive_after(lambda layer=layer, x=x: layer(x).sum())
    # none: GELU's input, dropout's output and mask, the norm's input and statistics;
    # selective: the two linears' outputs (4 x 64 and 4 x 16 floats); full: nothing new (the
    # layer's input is the caller's).
    assert kept["full"] == 0, kept
    assert kept["selective"] == (4 * 64 + 4 * 16) * 4, kept
    assert kept["none"] > kept["selective"]
    assert torch.ops.aten.mm.default in SAVED_OPS


def test_fsdp_bf16_parameters_stay_within_bf16_tolerance_of_autocast(tmp_path: Path) -> None:
    """bf16 compute two ways under FSDP 2 with selective checkpointing: autocast over fp32
    parameters, and FSDP2's policy (bf16 parameters and compute, fp32 reduction and master
    state). bf16 keeps 8 bits of mantissa: 20 steps agree within 2%, and both train."""
    losses = {}
    for mp in ("autocast", "fsdp"):
        spec = job(f"llama-{mp}", tmp_path / mp, "llama", precision="bf16", mixed_precision=mp)
        plan = Plan.fully_sharded(2, mixed_precision=mp, activation_checkpointing="selective")
        losses[mp] = [e.loss for e in run(spec, plan).steps]
    assert losses["fsdp"] != losses["autocast"]  # the policy did change the arithmetic
    for got, want in zip(losses["fsdp"], losses["autocast"], strict=True):
        assert abs(got - want) <= 0.02 * abs(want), (got, want)
    assert losses["fsdp"][-1] < losses["fsdp"][0] - 0.3


def test_a_checkpoint_moves_exactly_between_checkpointing_precision_and_plans(tmp_path: Path) -> None:
    """Saved at step 10 under FSDP 2 with bf16 parameters (FSDP2's policy) and full
    checkpointing: the state is fp32, named and shaped as without either. Restored from two
    copies of that checkpoint, under tp 2 with selective checkpointing and under one process
    without, in fp32: each tp rank's restore is its box of the saved tensors bit for bit, and
    steps 11-20 agree, so both restored the same state."""
    spec = job("moves", tmp_path, "llama", precision="bf16", mixed_precision="fsdp")
    run(spec, with_ac(Plan.fully_sharded(2, mixed_precision="fsdp"), "full"), until_step=10)
    saved = final_state(spec, 10)
    plain = job("moves", tmp_path / "plain", "llama")
    run(plain, Plan.data_parallel(1), until_step=10)
    expected = final_state(plain, 10)
    assert saved.keys() == expected.keys()
    for name, tensor in saved.items():
        assert tensor.dtype == expected[name].dtype and tensor.shape == expected[name].shape, name
    # Bitwise: what each rank of the other plan reads back (the workers' own restore) is its box
    # of the saved tensors, byte for byte.
    other = with_ac(mesh_plan({"tp": 2}), "selective")
    layout = state_layout(other, spec.model, rng_state_bytes(torch.device("cpu")))
    for rank in range(other.devices):
        restored = restore_latest(checkpoint_store(spec), layout, rank)
        assert restored is not None and restored.step == 10
        boxes = {n: t for n, t in restored.tensors.items() if n in saved}
        assert boxes and any(box.numel() < saved[name].numel() for name, box in boxes.items())  # tp splits some
        for name, box in boxes.items():
            want = saved[name][box_index(layout.tensors[name].holders[rank])]
            assert box.dtype == want.dtype and torch.equal(box, want.reshape(box.shape)), name
    shutil.copytree(tmp_path / "store", tmp_path / "copy")
    fp32 = {"precision": "fp32"}
    tp = job("moves", tmp_path, "llama", **fp32)
    one = job("moves", tmp_path, "llama", **fp32).model_copy(
        update={"storage": spec.storage.model_copy(update={"url": f"file://{tmp_path}/copy"})})
    resumed_tp = run(tp, with_ac(mesh_plan({"tp": 2}), "selective"))
    resumed_one = run(one, Plan.data_parallel(1))
    assert resumed_tp.start.step == resumed_one.start.step == 10
    tp_losses = [e.loss for e in resumed_tp.steps]
    one_losses = [e.loss for e in resumed_one.steps]
    assert len(tp_losses) == len(one_losses) == 10
    for got, want in zip(tp_losses, one_losses, strict=True):
        assert abs(got - want) <= 1e-5 * abs(want), (got, want)
