"""A model without an op graph (the hf family) is planned from measurements of itself: each
option of the data axis (replicated, HSDP, FSDP) costed, the fastest that fits chosen."""

from __future__ import annotations

import pytest
from parashift.planner.comm import default_comm
from parashift.planner.measured import (
    MeasuredProfile,
    measured_options,
    option_cost,
    plan_measured,
    profile_from_measurements,
)
from parashift.planner.profile import DEFAULT_DEVICES

PROFILE = MeasuredProfile(name="hf-llama", n_params=100_000_000, flops_per_token=6e8, layer_params=10_000_000,
                          root_params=20_000_000, sequence_s=0.01, activation_bytes=50e6,
                          device=DEFAULT_DEVICES["cuda"], comm=default_comm("cuda"))


def test_replicated_when_memory_allows_and_sharded_when_it_does_not() -> None:
    roomy = plan_measured(PROFILE, 8, global_batch=64, micro_batch=8)
    assert roomy.strategy == "measured" and roomy.dp_shard == 1 and roomy.feasible
    assert "no op graph" in roomy.notes[0] and "dp_shard 8" in roomy.notes[0]
    replicated = option_cost(PROFILE, 8, 1, 64, 8).memory_bytes
    tight = plan_measured(PROFILE, 8, 64, 8, memory_limit_bytes=int(replicated * 0.6))
    assert tight.dp_shard > 1 and tight.memory_per_device_bytes <= replicated * 0.6
    # Sharding costs gathers: never faster than replicating where both fit.
    assert tight.estimated_step_s >= roomy.estimated_step_s
    nothing = plan_measured(PROFILE, 8, 64, 8, memory_limit_bytes=1)
    assert not nothing.feasible and nothing.dp_shard == 8  # the least memory


def test_options_are_every_fitting_dp_shard_fastest_first() -> None:
    options = measured_options(PROFILE, 4, 32, 8)
    assert sorted(p.dp_shard for p in options) == [1, 2, 4]
    assert options[0].dp_shard == plan_measured(PROFILE, 4, 32, 8).dp_shard
    assert [p.estimated_step_s for p in options[1:]] == sorted(p.estimated_step_s for p in options[1:])


def test_checkpointing_is_chosen_only_where_memory_needs_it_and_priced_as_measured() -> None:
    """Each mode priced from its own measurement: where every option fits without checkpointing
    none is chosen (selective adds no FLOPs, so ties go to the earlier mode); where only a
    checkpointed one fits, it is chosen and fits; "full" pays the layers' forward again; a mode
    the profile was not measured under is not searched."""
    from parashift.specs.plan import AC_MODES

    profile = PROFILE.model_copy(update={"activation_bytes_by_ac": {"selective": 20e6, "full": 5e6},
                                         "layer_kept_by_ac": {"none": 4e6, "selective": 1.5e6, "full": 0.2e6}})
    roomy = plan_measured(profile, 8, 64, 8, ac_modes=AC_MODES)
    assert (roomy.activation_checkpointing, roomy.dp_shard) == ("none", 1)
    state = option_cost(profile, 8, 8, 64, 8).memory_bytes - 50e6 * 8  # the least state, sharded 8 ways
    limit = int(state + 30e6 * 8)  # below any option without checkpointing
    tight = plan_measured(profile, 8, 64, 8, memory_limit_bytes=limit, ac_modes=AC_MODES)
    assert tight.feasible and tight.activation_checkpointing == "selective" and tight.memory_per_device_bytes <= limit
    selective = option_cost(profile, 8, 8, 64, 8, "selective")
    assert selective.memory_bytes == state + (20e6 + 4e6 - 1.5e6) * 8  # a layer's whole again while its backward runs
    full, plain = option_cost(profile, 8, 8, 64, 8, "full"), option_cost(profile, 8, 8, 64, 8)
    layers_share = (100e6 - 20e6) / 100e6
    assert full.step_s - plain.step_s == pytest.approx(0.01 * 8 * layers_share / 3)
    assert plan_measured(PROFILE, 8, 64, 8, memory_limit_bytes=limit, ac_modes=AC_MODES).activation_checkpointing == "none"
    assert {p.activation_checkpointing for p in measured_options(profile, 8, 64, 8, ac_modes=AC_MODES)} == set(AC_MODES)


def test_weight_copies_are_held_once_per_micro_batch_and_not_under_fsdp2s_policy() -> None:
    """Autocast's bf16 weight copies are made once per forward, whatever its batch: counted
    once, not once per sequence of the micro-batch. Under FSDP2's bf16 policy (with a data axis)
    there are none, and weights are gathered in bf16: half the gathered memory and traffic."""
    casts = PROFILE.model_copy(update={"cast_bytes": 10e6})
    plain, with_casts = option_cost(PROFILE, 8, 4, 64, 8), option_cost(casts, 8, 4, 64, 8)
    assert with_casts.memory_bytes - plain.memory_bytes == 10e6
    policy = option_cost(casts, 8, 4, 64, 8, mixed_precision="fsdp")
    gathered = 4 * (PROFILE.root_params + 2 * PROFILE.layer_params)
    assert plain.memory_bytes - policy.memory_bytes == gathered / 2
    assert policy.step_s < plain.step_s  # the gathers move half the bytes
    # one device has no data axis: autocast runs, copies and all
    assert option_cost(casts, 1, 1, 64, 8, mixed_precision="fsdp") == option_cost(casts, 1, 1, 64, 8)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_what_a_checkpointed_model_keeps_is_measured_as_the_trainer_checkpoints_it(precision: str) -> None:
    """Each mode's bytes, from the short small copies, equal the whole model's at the whole
    context with the trainer's own checkpointing (trainer.recompute.apply_ac on every layer):
    the same difference to what the forward leaves alive without it, over the same base."""
    import torch
    from parashift.models import family_of
    from parashift.models.hf.spec import HFSpec
    from parashift.models.layers import token_loss_sum
    from parashift.specs.plan import AC_MODES
    from parashift.trainer.measure_model import _Logits, _sequence, measure_for_gpus
    from parashift.trainer.memory import alive_after, kept_for_backward, kept_parts
    from parashift.trainer.recompute import apply_ac

    config = {"model_type": "qwen2", "num_hidden_layers": 3, "hidden_size": 32, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": 1000}
    spec = HFSpec(family="hf", seq_len=200, config=config)
    measured = measure_for_gpus(spec, precision, modes=AC_MODES)
    family = family_of(spec)
    for mode in ("selective", "full"):
        model = family.build(spec)
        inputs, targets = _sequence(spec, model, 1, 0)
        kept = kept_for_backward(_Logits(family, model), inputs, targets, precision)

        def forward(model: torch.nn.Module = model, inputs: torch.Tensor = inputs,
                    targets: torch.Tensor = targets) -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
                return token_loss_sum(family.logits(model, inputs), targets)

        plain = alive_after(forward)
        apply_ac([layer for _, layer in family.layers(model)], mode)
        total = measured["activation_bytes_by_ac"][mode] + measured["cast_bytes_by_ac"][mode]
        assert total == kept + alive_after(forward) - plain, mode
    assert measured["layer_kept_by_ac"]["full"] == 200 * 32 * 4  # a layer keeps its input: the fp32 residual stream
    # autocast's bf16 weight copies, once per forward (not per sequence): every GEMM's weight, the head's too
    model = family.build(spec)
    gemm_weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert measured["cast_bytes"] == (2 * gemm_weights if precision == "bf16" else 0)
    casts = [kept_parts(_Logits(family, model), *_sequence(spec, model, batch, 0), precision)[0] for batch in (1, 3)]
    assert casts[0] == casts[1] == measured["cast_bytes"]


def test_a_transformers_model_is_measured() -> None:
    from parashift.models.hf.spec import HFSpec
    from parashift.trainer.measure_model import measure_model

    spec = HFSpec(family="hf", seq_len=16, config={"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 32,
                                                   "num_attention_heads": 4, "intermediate_size": 64, "vocab_size": 256})
    measured = measure_model(spec, 2, "fp32")
    assert measured["sequence_s"] > 0 and measured["activation_bytes"] > 16 * 32 * 4
    assert measured["n_params"] == measured["root_params"] + 2 * measured["layer_params"]
    profile = profile_from_measurements("hf-llama", measured, "cpu", workers=4, seq_len=16)
    assert profile.sequence_s > measured["sequence_s"]  # 4 workers share this machine's cores
    # A GPU is not timed by this CPU: its sequence is the model's FLOPs at the device's rate.
    gpu = profile_from_measurements("hf-llama", measured, "cuda", workers=4, seq_len=16)
    assert gpu.sequence_s == pytest.approx(measured["flops_per_token"] * 16 / gpu.device.matmul_flops)
    assert gpu.sequence_s < measured["sequence_s"] / 100 and gpu.sequence_from == "flops"
    assert gpu.activation_bytes == measured["activation_bytes"]


def test_parashift_plan_says_whether_an_hf_models_state_is_sharded(tmp_path) -> None:
    """`parashift plan` on a model without an op graph: measured here, then one line that says
    replicated (it said "sharded over 1") or sharded over how many."""
    import json

    from typer.testing import CliRunner

    from parashift.cli import app

    config = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 256}
    spec = tmp_path / "job.yaml"
    spec.write_text(json.dumps({"name": "hf-plan", "model": {"family": "hf", "config": config, "seq_len": 16},
                                "training": {"global_batch": 8, "micro_batch": 2}, "resources": {"devices": 2}}))
    out = CliRunner().invoke(app, ["plan", str(spec), "--devices", "2"])
    assert out.exit_code == 0, out.output
    assert out.output.splitlines()[0].startswith("hf-") and ": dp 2, state replicated (" in out.output.splitlines()[0]


LONG_CONTEXT_CONFIGS = {
    "llama-gqa": {"model_type": "llama", "num_key_value_heads": 2},
    "gpt2": {"model_type": "gpt2", "n_layer": 3, "n_embd": 32, "n_head": 4, "n_positions": 1024},
    "qwen2-eager": {"model_type": "qwen2", "num_key_value_heads": 2},  # eager attention keeps T x T scores
    "mistral-window": {"model_type": "mistral", "num_key_value_heads": 2, "sliding_window": 100},
    # eager (no sdpa), local and global layers in turn, soft-capped scores
    "gemma2-window": {"model_type": "gemma2", "num_key_value_heads": 2, "head_dim": 8, "sliding_window": 100},
    # a mixture of experts: what its experts keep follows the tokens routed to them
    "qwen3-moe": {"model_type": "qwen3_moe", "num_key_value_heads": 2, "head_dim": 8, "num_experts": 8,
                  "num_experts_per_tok": 2, "moe_intermediate_size": 16},
}


# bf16 for every architecture (autocast's casts and fp32 norm inputs on top of fp32's tensors), fp32 for one
@pytest.mark.parametrize(("name", "precision"), [(name, "bf16") for name in LONG_CONTEXT_CONFIGS] + [("llama-gqa", "fp32")])
def test_a_long_context_is_measured_on_short_sequences_exactly(name: str, precision: str) -> None:
    """What a sequence keeps is measured at three short lengths and extended to the context (a
    7B-wide layer's forward over 4,096 tokens took minutes on the flow's CPU): equal to the whole
    model's measurement at the context, with GQA, eager attention (quadratic in the length)
    and a sliding window shorter than the context (the copies' cut shorter than the probes)."""
    from parashift.models.hf.spec import HFSpec
    from parashift.trainer.measure_model import PROBE_LENGTHS, measure_for_gpus, measure_model

    config = {"num_hidden_layers": 3, "hidden_size": 32, "num_attention_heads": 4, "intermediate_size": 64,
              "vocab_size": 1000, **LONG_CONTEXT_CONFIGS[name]}
    spec = HFSpec(family="hf", seq_len=400, config=config, attn_implementation="eager" if "eager" in name else "auto")
    assert spec.seq_len > max(PROBE_LENGTHS)
    whole, gpu = measure_model(spec, 1, precision, repeats=1), measure_for_gpus(spec, precision)
    assert gpu["activation_bytes"] == whole["activation_bytes"]


def test_measuring_what_a_forward_keeps_keeps_nothing_after_it() -> None:
    """The saved tensors were packed as themselves: a saved output then refers to its own
    grad_fn, a cycle the collector cannot see, and the model's parameters outlived the
    measurement (a Qwen2 7B shape's copies held 9.6 GB at once)."""
    import gc
    import weakref

    import torch
    from parashift.models import family_of
    from parashift.models.hf.spec import HFSpec
    from parashift.trainer.measure_model import _Logits
    from parashift.trainer.memory import kept_for_backward

    spec = HFSpec(family="hf", seq_len=16, config={"model_type": "qwen2", "num_hidden_layers": 1, "hidden_size": 32,
                                                   "num_attention_heads": 4, "num_key_value_heads": 2,
                                                   "intermediate_size": 64, "vocab_size": 256})
    family = family_of(spec)
    for precision in ("fp32", "bf16"):
        model = family.build(spec)
        parameter = weakref.ref(next(model.parameters()))
        tokens = torch.randint(0, 256, (1, 17))
        assert kept_for_backward(_Logits(family, model), tokens[:, :-1], tokens[:, 1:], precision) > 0
        del model
        gc.collect()
        assert parameter() is None, precision


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_gpu_model_is_measured_without_building_it_whole(model_type: str, precision: str) -> None:
    """A GPU job's hf model was built whole on the flow's CPU and timed there (an 8B model: 32 GB
    and half an hour on one thread). Its counts now come from the meta device and its kept bytes
    from small copies (1 and 2 layers, 256 and 512 ids), extended to its depth and vocabulary:
    equal to the whole model's measurement."""
    from parashift.models.hf.spec import HFSpec
    from parashift.trainer.measure_model import measure_for_gpus, measure_model

    # 1,000 ids: the small copies' 256 and 512 extended to them; a pad id beyond the copies'
    config = ({"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 32, "num_attention_heads": 4,
               "intermediate_size": 64, "vocab_size": 1000, "pad_token_id": 999} if model_type == "llama" else
              {"model_type": "gpt2", "n_layer": 4, "n_embd": 32, "n_head": 4, "vocab_size": 1000})
    spec = HFSpec(family="hf", seq_len=16, config=config)
    whole, gpu = measure_model(spec, 1, precision, repeats=1), measure_for_gpus(spec, precision)
    for key in ("activation_bytes", "n_params", "layer_params", "root_params", "flops_per_token"):
        assert gpu[key] == whole[key], key


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_measured_hf_llama_keeps_what_the_llama_familys_op_graph_plans(precision: str) -> None:
    """Two independent routes to one number: the Llama family's op graph (what the planner
    prices each op to keep, planner/builders.py) and the `hf` measurement of transformers'
    LlamaForCausalLM of the same shape (short sequences, small copies, extended). They agree
    within 0.5% here (and to 0.5 MiB of 7,436 MiB for a Llama 3.2 1B shape, BENCHMARKS.md)."""
    from parashift.models import family_of
    from parashift.models.hf.spec import HFSpec
    from parashift.planner.costs import data_parallel_activation_bytes
    from parashift.specs import JobSpec
    from parashift.trainer.measure_model import measure_for_gpus

    shape = {"n_layers": 3, "d_model": 64, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 160, "vocab_size": 1000,
             "seq_len": 96}
    llama = JobSpec.model_validate({"name": "x", "model": {"family": "llama", **shape}, "resources": {"devices": 1},
                                    "training": {"global_batch": 1, "micro_batch": 1}}).model
    hf = HFSpec(family="hf", seq_len=96, config={
        "model_type": "llama", "num_hidden_layers": 3, "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 160, "vocab_size": 1000, "tie_word_embeddings": False})
    planned = data_parallel_activation_bytes(family_of(llama).graph(llama, 1, precision))
    measured = measure_for_gpus(hf, precision)
    assert measured["activation_bytes"] + measured["cast_bytes"] == pytest.approx(planned, rel=5e-3)
