"""The `hf` family: a `transformers` causal LM built from a config trains under data
parallelism, FSDP and HSDP on 2 and 4 CPU workers with the single process's loss at every step,
moves exactly between those plans (its checkpoints are parallelizable tensor collections like
every family's), resumes on the rest after `kill -9` of a worker, and exports a checkpoint that
`transformers` loads."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
from jobs import assert_losses_match, descendants, final_state, mesh_plan, run, tiny_spec
from parashift.launcher.launch import launch_workers
from parashift.specs import JobSpec
from parashift.specs.plan import Plan
from parashift.trainer.events import CheckpointEvent

pytestmark = pytest.mark.slow

# A Llama-architecture transformers config (grouped-query attention), untied.
LLAMA = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": 256}
TRAINING = {"global_batch": 8, "micro_batch": 4, "steps": 12, "seed": 7, "checkpoint_every": 3}


def hf_spec(name: str, tmp: Path, config: dict = LLAMA, **training: int) -> JobSpec:
    base = tiny_spec(name, f"file://{tmp}/store", training={**TRAINING, **training})
    return JobSpec.model_validate({**base.model_dump(), "model": {"family": "hf", "seq_len": 32, "config": config}})


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    spec = hf_spec("reference", tmp_path_factory.mktemp("hf-reference"))
    losses = [e.loss for e in run(spec, Plan.data_parallel(1)).steps]
    assert len(losses) == 12 and losses[-1] < losses[0] - 0.2
    return losses


def test_dp_fsdp_hsdp_on_2_and_4_workers_move_exactly(reference: list[float], tmp_path: Path) -> None:
    """dp 2 -> FSDP 4 -> HSDP 2 x 2 -> FSDP 2, three steps each, every segment resuming the
    last one's checkpoint: the single process's loss at every step, then a Hugging Face export
    that transformers loads with parashift's weights."""
    spec = hf_spec("moves", tmp_path)
    plans = [Plan.data_parallel(2), Plan.fully_sharded(4), mesh_plan({"dp": 4}, dp_shard=2), Plan.fully_sharded(2)]
    for i, plan in enumerate(plans):
        result = run(spec, plan, until_step=3 * (i + 1))
        assert result.start.step == 3 * i
        assert_losses_match(result, reference)
    from parashift.trainer.export import export_hf
    from transformers import AutoModelForCausalLM

    export_hf(spec, str(tmp_path / "hf"))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32)
    state = final_state(spec)
    for name, param in loaded.named_parameters():
        assert torch.equal(param.detach(), state[f"model/{name}"]), name


def test_a_killed_worker_resumes_on_the_rest(reference: list[float], tmp_path: Path) -> None:
    """FSDP on 3 workers; one is killed with SIGKILL after the first checkpoint: the launch
    fails, and the job resumes from that checkpoint on the 2 left with the reference's losses."""
    spec = hf_spec("killed", tmp_path)
    killed: list[int] = []

    def on_event(event: object) -> None:
        if isinstance(event, CheckpointEvent) and not killed:
            workers = [p for p in descendants(os.getpid())
                       if b"parashift.trainer.worker" in Path(f"/proc/{p}/cmdline").read_bytes()]
            victim = workers[-1]
            killed.append(victim)
            os.kill(victim, signal.SIGKILL)

    failed = launch_workers(spec, Plan.fully_sharded(3), on_event=on_event)
    assert killed and failed.returncode != 0
    time.sleep(0.5)
    resumed = run(spec, Plan.fully_sharded(2))
    start = resumed.start
    assert start.resumed and start.step >= 3 and resumed.final_step == 12
    assert_losses_match(resumed, reference)


def test_gpt2_tied_embeddings_under_fsdp_equal_one_process(tmp_path: Path) -> None:
    """GPT-2 ties its head to the token embedding: the tie survives building on the meta
    device, FSDP2 and materialisation (one parameter in the checkpoint), and FSDP 2 gives the
    single process's losses."""
    gpt2 = {"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 256, "n_positions": 64,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}  # dropout draws differ by rank
    one = hf_spec("gpt2-one", tmp_path, gpt2, steps=4)
    expected = [e.loss for e in run(one, Plan.data_parallel(1)).steps]
    sharded = hf_spec("gpt2-fsdp", tmp_path, gpt2, steps=4)
    assert_losses_match(run(sharded, Plan.fully_sharded(2)), expected)
    assert "model/lm_head.weight" not in final_state(sharded) and "model/transformer.wte.weight" in final_state(sharded)


def test_plans_an_hf_model_cannot_run_are_refused_with_reasons(tmp_path: Path) -> None:
    """Data parallelism only, and no sequence longer than the model's positions: the config's
    own number, or (where the config leaves it out) its class's default, read from transformers."""
    from parashift.models.plans import job_plan_refusals

    assert job_plan_refusals(Plan.data_parallel(2), hf_spec("dp", tmp_path)) == []
    tp = job_plan_refusals(mesh_plan({"tp": 2}), hf_spec("tp", tmp_path))
    assert tp == ["the hf family runs data parallelism only (dp, FSDP, HSDP): it has no sharding table for tp"]
    gpt2 = {"model_type": "gpt2", "n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 256}
    short = hf_spec("short", tmp_path, config={**gpt2, "n_positions": 16})
    assert job_plan_refusals(Plan.data_parallel(1), short) == ["seq_len 32 is longer than the model's 16 positions"]
    default = hf_spec("default", tmp_path, config=gpt2)  # GPT2Config's default: 1024 positions
    longer = default.model_copy(update={"model": default.model.model_copy(update={"seq_len": 2048})})
    assert job_plan_refusals(Plan.data_parallel(1), longer) == ["seq_len 2048 is longer than the model's 1024 positions"]


def test_a_model_section_says_what_its_family_can_shard() -> None:
    """`sharded` on each model section (read where a plan is checked, without torch) agrees with
    its family having a sharding table (what the trainer shards by)."""
    from parashift.models import FAMILIES, family, spec_sections

    assert {name: section.sharded for name, section in spec_sections().items()} == \
        {name: family(name).sharding is not None for name in FAMILIES}


def test_gemma_2_without_sdpa_trains_under_fsdp_with_one_process_s_losses(tmp_path: Path) -> None:
    """Gemma 2 has no sdpa kernel in transformers: the default `attn_implementation: auto` is
    transformers' own choice (eager here; sdpa for the Llama config), where a fixed sdpa made
    every Gemma 2 spec fail at its first build. Its tied head, soft-capped logits and sliding-
    window layers under FSDP 2 give the single process's losses."""
    from parashift.models import family

    gemma2 = {"model_type": "gemma2", "num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 64, "vocab_size": 256,
              "sliding_window": 16}
    one = hf_spec("gemma2-one", tmp_path, gemma2, steps=4)
    hf = family("hf")
    assert hf.build_on_meta(one.model).config._attn_implementation == "eager"
    assert hf.build_on_meta(hf_spec("llama", tmp_path).model).config._attn_implementation == "sdpa"
    expected = [e.loss for e in run(one, Plan.data_parallel(1)).steps]
    assert_losses_match(run(hf_spec("gemma2-fsdp", tmp_path, gemma2, steps=4), Plan.fully_sharded(2)), expected)


@pytest.mark.parametrize(("config", "field", "says"), [
    ({"model_type": "gpt_neoxx"}, "model.config.model_type",
     "transformers knows no model type 'gpt_neoxx' (did you mean gpt_neox or gpt_neo or gpt_oss?)"),
    ({"model_type": "vit"}, "model.config.model_type",
     "'vit' is not a causal LM in transformers (AutoModelForCausalLM has no class for it)"),
    ({**LLAMA, "num_attention_heads": 5}, "model.config",
     "transformers refuses it: The hidden size (32) is not a multiple of the number of attention heads"),
    ({"model_type": "gemma2", "attn": "sdpa"}, "model.attn_implementation",
     "Gemma2ForCausalLM does not support an attention implementation through "
     "torch.nn.functional.scaled_dot_product_attention yet: use auto (transformers' choice) or eager"),
], ids=["unknown-type", "not-a-causal-lm", "bad-field", "no-sdpa"])
def test_a_model_transformers_cannot_build_is_one_line_naming_the_field(tmp_path: Path, config: dict, field: str,
                                                                       says: str) -> None:
    """What only building the model finds (transformers' own checks) is a preflight problem of
    one line at the spec's field, not a traceback (an unknown model type's listed ~800 types)."""
    from parashift.tasks.preflight import preflight

    config = dict(config)
    attention = config.pop("attn", "auto")
    base = hf_spec("unbuildable", tmp_path)
    spec = JobSpec.model_validate({**base.model_dump(), "model": {"family": "hf", "seq_len": 32, "config": config,
                                                                  "attn_implementation": attention}})
    (problem,) = preflight(spec, storage=False, data=False)
    assert (problem.field, problem.message[:len(says)]) == (field, says), problem


@pytest.mark.parametrize(("config", "routed"), [
    ({"model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16}, 2 / 8),
    ({"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2}, 2 / 4),
    ({"model_type": "llama"}, 1.0),
], ids=["qwen3-moe", "mixtral", "dense"])
def test_a_mixture_of_experts_counts_the_flops_of_the_experts_a_token_is_routed_to(tmp_path: Path, config: dict,
                                                                                  routed: float) -> None:
    """FLOPs per token (the GPU step estimate, MFU) count a routed expert's parameters at k/E:
    all of them made Qwen3-30B-A3B's estimate and MFU 9x its real ones (30.5B parameters, 3.35B a
    token). Shared weights (attention, router, embeddings) count whole."""
    from parashift.models import family

    shape = {"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
             "intermediate_size": 64, "vocab_size": 256}
    spec = hf_spec("moe", tmp_path, config={**shape, **config}).model
    hf = family("hf")
    named = [(name, p.numel()) for name, p in hf.build_on_meta(spec).named_parameters()]
    experts = sum(n for name, n in named if "experts" in name.split("."))
    total = sum(n for _, n in named)
    assert (experts > 0) == (routed < 1.0)
    attention = 12 * spec.n_layers * spec.d_model * spec.seq_len
    assert hf.flops_per_token(spec, total) == 6 * (total - experts + round(experts * routed)) + attention
    wide = hf_spec("wide-heads", tmp_path, config={**shape, **config, "head_dim": 16}).model  # 4 x 16 over width 32
    assert wide.attention_width == 64 and hf.flops_per_token(wide, total) - hf.flops_per_token(spec, total) == attention
