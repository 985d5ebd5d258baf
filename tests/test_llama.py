"""The Llama family against the real `transformers` and against itself under every plan kind.

- A folder `transformers` writes (LlamaConfig with grouped-query attention and Llama 3.1 rotary
  scaling; Qwen2Config with q/k/v biases and tied embeddings) loads into parashift with the same
  logits (fp32, 1e-5).
- Every kind of Plan the GPT runs (dp, tp 2/4 with sequence parallelism and a vocab-parallel
  head, pp 2, FSDP, HSDP, pp x tp, pp x FSDP held) gives the single process's loss at each of
  the first 10 of its 20 steps, and its state there; checkpoints move exactly between them; an
  elastic 2 -> 3 -> 1 run with tp and dp changing equals the static run at every step.
- A checkpoint trained under tp 2 x dp 2, exported with `parashift export`, loads into
  `transformers.AutoModelForCausalLM.from_pretrained` with the logits parashift computes.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from jobs import assert_losses_match, assert_state_matches, final_state, mesh_plan, run, tiny_spec
from parashift.models import family
from parashift.models.llama.spec import LlamaSpec
from parashift.specs import JobSpec, load_spec
from parashift.specs.loader import resolve_model
from parashift.specs.plan import Plan

# 8 query heads in 4 groups (grouped-query attention that tp 2 and 4 split), head width 6.
MODEL = {"family": "llama", "n_layers": 2, "d_model": 48, "n_heads": 8, "n_kv_heads": 4, "ffn_dim": 80,
         "vocab_size": 256, "seq_len": 24, "rope_theta": 500000.0}
TRAINING = {"global_batch": 8, "micro_batch": 4, "steps": 20, "seed": 7, "checkpoint_every": 10}
HALF = 10  # each plan trains the job's first half (stopped there: the reference's schedule)
LLAMA = family("llama")


def llama_spec(name: str, tmp: Path, **model: object) -> JobSpec:
    return resolve_model(tiny_spec(name, f"file://{tmp}/store", model={**MODEL, **model}, training=TRAINING))


def parashift_logits(spec: LlamaSpec, state: dict[str, torch.Tensor] | None, tokens: torch.Tensor) -> torch.Tensor:
    """The model `spec` describes, weights from `state` (checkpoint names) or its init_from."""
    model = LLAMA.build(spec)
    with torch.no_grad():
        for name, param in model.named_parameters():
            value = state[f"model/{name}"] if state is not None else LLAMA.initial_value(spec, name, tuple(param.shape), 0)
            param.copy_(value)
        return model(tokens)


def transformers_folder(tmp: Path, kind: str) -> Path:
    """A random `transformers` model of `kind`, saved by `save_pretrained` (safetensors)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    shape = {"hidden_size": 48, "intermediate_size": 80, "num_hidden_layers": 2, "num_attention_heads": 8,
             "num_key_value_heads": 4, "vocab_size": 256}
    if kind == "llama":
        config = LlamaConfig(**shape, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8})
    else:
        config = Qwen2Config(**shape, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():  # transformers initialises biases to 0: make them count
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.1)
    folder = tmp / kind
    model.save_pretrained(folder)
    return folder


def transformers_logits(folder: Path | str, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32, attn_implementation="sdpa").eval()
    with torch.no_grad():
        return model(tokens).logits


TOKENS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_a_transformers_folder_loads_with_the_same_logits(kind: str, tmp_path: Path) -> None:
    folder = transformers_folder(tmp_path, kind)
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text(f"name: from-hf\nmodel: {{family: llama, init_from: {folder}, seq_len: 24}}\n")
    spec = load_spec(spec_file).model
    assert (spec.n_kv_heads, spec.attention_bias, spec.tie_embeddings) == \
        ((4, False, False) if kind == "llama" else (4, True, True))
    ours = parashift_logits(spec, None, TOKENS)
    theirs = transformers_logits(folder, TOKENS)
    assert torch.allclose(ours, theirs, rtol=0, atol=1e-5), (ours - theirs).abs().max()


def test_a_folder_that_is_not_a_llama_is_refused_in_one_line(tmp_path: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=256)).save_pretrained(tmp_path / "gpt2")
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text(f"name: wrong\nmodel:\n  family: llama\n  init_from: {tmp_path / 'gpt2'}\n")
    with pytest.raises(Exception, match=r"job.yaml:4:14: model.init_from: .*'GPT2LMHeadModel' is not the Llama family's"):
        load_spec(spec_file)
    folder = transformers_folder(tmp_path, "llama")
    spec_file.write_text(f"name: wrong\nmodel:\n  family: llama\n  init_from: {folder}\n  n_heads: 4\n")
    with pytest.raises(Exception, match=r"job.yaml:5:12: model.n_heads: is 4 but .*config.json says 8"):
        load_spec(spec_file)


def test_a_folder_of_pickled_weights_is_refused_where_the_spec_is_read(tmp_path: Path) -> None:
    """Workers would fail on it one by one after the launch: `validate` says it, at the field."""
    folder = transformers_folder(tmp_path, "llama")
    for saved in folder.glob("*.safetensors"):
        saved.unlink()
    (folder / "pytorch_model.bin").write_bytes(b"not read")  # torch.save's pickle: never loaded
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text(f"name: pickled\nmodel:\n  family: llama\n  init_from: {folder}\n")
    with pytest.raises(Exception, match=r"job.yaml:4:14: model.init_from: .* holds no model.safetensors .*"
                                        r"pytorch_model.bin: pickle, never loaded"):
        load_spec(spec_file)


def test_weights_that_do_not_fit_the_model_end_the_job_at_once(tmp_path: Path) -> None:
    """An input every retry would read again is fatal, with its reason, not a crash to retry."""
    from jobs import warm_pool
    from parashift.trainer.metrics import EXIT_FATAL
    from safetensors.torch import load_file, save_file

    folder = transformers_folder(tmp_path, "llama")
    weights = load_file(str(folder / "model.safetensors"))
    del weights["model.norm.weight"]
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    base = tiny_spec("bad-weights", f"file://{tmp_path / 'store'}")
    spec = resolve_model(JobSpec.model_validate({**base.model_dump(exclude={"model"}),
                                                  "model": {"family": "llama", "init_from": str(folder), "seq_len": 24}}))
    result = warm_pool().run(spec, Plan.data_parallel(2))
    assert result.returncode == EXIT_FATAL, result
    assert result.fatal is not None and "model.init_from" in result.fatal.message
    assert "has no tensor model.norm.weight" in result.fatal.message


# ---------------------------------------------------------------------------------- plans

PLANS = {
    "dp2xtp2": lambda: mesh_plan({"dp": 2, "tp": 2}),  # Megatron + sequence parallel + vocab-parallel head and loss
    "tp4": lambda: mesh_plan({"tp": 4}),  # one kv head per rank
    "pp2xdp2": lambda: mesh_plan({"pp": 2, "dp": 2}, micro_batches=2),
    "pp2xtp2": lambda: mesh_plan({"pp": 2, "tp": 2}, micro_batches=4),
    "fsdp4": lambda: Plan.fully_sharded(4),
    "hsdp2x2": lambda: mesh_plan({"dp": 4}, dp_shard=2),
    "pp2xfsdp2-held": lambda: mesh_plan({"pp": 2, "dp": 2}, dp_shard=2, micro_batches=4, reshard_after_forward=False),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[float], dict[str, torch.Tensor],
                                                              dict[str, torch.Tensor]]:
    """One process, no parallelism: the losses, the final state and the state at step HALF
    every plan must reproduce."""
    spec = llama_spec("reference", tmp_path_factory.mktemp("reference"))
    result = run(spec, Plan.data_parallel(1))
    losses = [e.loss for e in result.steps]
    assert len(losses) == 20 and losses[-1] < losses[0] - 0.3
    return losses, final_state(spec), final_state(spec, step=HALF)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PLANS))
def test_plan_matches_single_process(name: str, reference, tmp_path: Path) -> None:
    expected_losses, _, expected_state = reference
    spec = llama_spec(name, tmp_path)
    result = run(spec, PLANS[name](), until_step=HALF)
    assert result.final_step == HALF
    assert_losses_match(result, expected_losses)
    assert_state_matches(final_state(spec), expected_state, noise_only=())
    if name == "dp2xtp2":  # exported, then loaded by transformers: parashift's logits
        from typer.testing import CliRunner

        from parashift.cli import app

        spec_file = tmp_path / "job.yaml"
        spec_file.write_text(spec.model_dump_json())
        out = CliRunner().invoke(app, ["export", str(spec_file), "--to", str(tmp_path / "hf"), "--max-shard-gb", "0.00003"])
        assert out.exit_code == 0, out.output
        missing = CliRunner().invoke(app, ["export", str(spec_file), "--to", str(tmp_path / "no"), "--step", "1"])
        assert missing.exit_code == 1 and f"its committed steps: {HALF}" in missing.output, missing.output
        assert len(list((tmp_path / "hf").glob("*.safetensors"))) > 1  # size-sharded, with its index
        ours = parashift_logits(spec.model, final_state(spec), TOKENS)
        theirs = transformers_logits(tmp_path / "hf", TOKENS)
        assert torch.allclose(ours, theirs, rtol=0, atol=1e-5), (ours - theirs).abs().max()


def test_unexecutable_llama_plans_are_refused_with_reasons(tmp_path: Path) -> None:
    from parashift.models.plans import job_plan_refusals

    spec = llama_spec("refusals", tmp_path)
    assert job_plan_refusals(mesh_plan({"tp": 4}), spec) == []
    eight = job_plan_refusals(mesh_plan({"tp": 8}), spec)
    assert any("n_kv_heads (4) must be divisible by tp (8)" in r for r in eight), eight
    tied = llama_spec("tied", tmp_path, tie_embeddings=True)
    assert any("tied" in r for r in job_plan_refusals(mesh_plan({"pp": 2}, micro_batches=2), tied))
    assert job_plan_refusals(mesh_plan({"dp": 2, "tp": 2}), tied) == []


def test_checkpoints_move_exactly_between_llama_plans(tmp_path: Path) -> None:
    """Under every pair of plans (no processes: the layouts the workers would have), each new
    rank's boxes read from the old plan's checkpoint equal the slices of the saved tensors, bit
    for bit, reading exactly the bytes needed."""
    from parashift.storage import CheckpointStore, ObjectStore
    from parashift.trainer.checkpoint import execute_reads, reshard_plan
    from parashift.trainer.layout import state_layout
    from states import box_of, global_state, save_all_ranks

    spec = llama_spec("moves", tmp_path, tie_embeddings=False)
    plans = {name: make() for name, make in PLANS.items()} | {"dp1": Plan.data_parallel(1), "dp3": Plan.data_parallel(3)}
    saved = {}
    for name, plan in plans.items():
        layout = state_layout(plan, spec.model)
        store = CheckpointStore(ObjectStore(f"file://{tmp_path}/{name}"), "job")
        state = global_state(layout)
        save_all_ranks(store, layout, state, step=3)
        saved[name] = (store, state)
    for old, new in itertools.permutations(plans, 2):
        store, state = saved[old]
        layout = state_layout(plans[new], spec.model)
        reconfig = reshard_plan(store, layout)
        assert reconfig is not None and reconfig.totals()["bytes_read"] == reconfig.totals()["bytes_needed"]
        for rank, reads in enumerate(reconfig.ranks):
            got = execute_reads(store, 3, reads)
            for name, box in layout.boxes_of(rank).items():
                if name.startswith("rng/"):
                    continue
                want = box_of(state[name], box)
                assert torch.equal(got[name], want), f"{old} -> {new}: rank {rank} {name}"


@pytest.mark.slow
def test_elastic_two_three_one_equals_the_static_run(reference, tmp_path: Path) -> None:
    """tp 2 on 2 devices -> dp 3 -> one device, resuming each time from the last checkpoint:
    the single process's loss at every step."""
    expected_losses, expected_state, _ = reference
    spec = llama_spec("elastic", tmp_path)
    segments = [(mesh_plan({"tp": 2}), 7), (Plan.data_parallel(3), 14), (Plan.data_parallel(1), None)]
    for i, (plan, until) in enumerate(segments):
        result = run(spec, plan, until_step=until)
        start = result.start
        assert start.step == (0, 7, 14)[i] and start.resumed == (i > 0)
        assert_losses_match(result, expected_losses)
    assert_state_matches(final_state(spec), expected_state, noise_only=())


@pytest.mark.slow
def test_a_qwen2_checkpoint_trains_under_tp_and_exports_to_transformers(tmp_path: Path) -> None:
    """Qwen2 (q/k/v biases, tied embeddings) from a transformers folder, 20 steps under
    tp 2 x dp 2, exported: transformers computes parashift's logits from the export."""
    from parashift.trainer.export import export_hf

    folder = transformers_folder(tmp_path, "qwen2")
    spec = tiny_spec("qwen", f"file://{tmp_path}/store", training=TRAINING)
    spec = resolve_model(spec.model_copy(update={"model": LlamaSpec(family="llama", init_from=str(folder), seq_len=24)}))
    assert spec.model.attention_bias and spec.model.tie_embeddings
    result = run(spec, mesh_plan({"dp": 2, "tp": 2}))
    assert result.final_step == 20 and result.steps[-1].loss < result.steps[0].loss
    # Each rank read its box of every weight from the folder: one process reading them whole
    # trains the same losses.
    whole = run(spec.model_copy(update={"name": "qwen-one"}), Plan.data_parallel(1))
    assert_losses_match(result, [e.loss for e in whole.steps])
    export_hf(spec, str(tmp_path / "hf"))
    ours = parashift_logits(spec.model, final_state(spec), TOKENS)
    theirs = transformers_logits(tmp_path / "hf", TOKENS)
    assert torch.allclose(ours, theirs, rtol=0, atol=1e-5), (ours - theirs).abs().max()


def test_an_export_keeps_what_its_source_folder_says_beyond_the_math(tmp_path: Path) -> None:
    """A model started from a folder, fine-tuned at a shorter context and exported: the config
    keeps the folder's token ids and the context it supports (they were dropped: an export
    generated with transformers' default end-of-sequence id and served 24 tokens of context),
    and the folder's tokenizer and generation defaults come along, byte for byte; a job that
    names a tokenizer of its own exports that one instead."""
    import json

    from parashift.corpus.tokenizer import save_tokenizer, train_bpe
    from parashift.trainer.export import export_hf
    from transformers import AutoModelForCausalLM, LlamaConfig

    folder = tmp_path / "source"
    config = LlamaConfig(hidden_size=48, intermediate_size=80, num_hidden_layers=1, num_attention_heads=8,
                         num_key_value_heads=4, vocab_size=256, bos_token_id=3, eos_token_id=4, pad_token_id=5,
                         max_position_embeddings=4096)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    save_tokenizer(train_bpe(["a source tokenizer " * 50], 300), str(folder))
    (folder / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast"}')
    assert (folder / "generation_config.json").exists()
    spec = tiny_spec("sourced", f"file://{tmp_path}/store", training={"steps": 2})
    spec = resolve_model(spec.model_copy(update={"model": LlamaSpec(family="llama", init_from=str(folder), seq_len=24)}))
    assert run(spec, Plan.data_parallel(1)).final_step == 2
    report = export_hf(spec, str(tmp_path / "hf"))
    exported = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (exported["bos_token_id"], exported["eos_token_id"], exported["pad_token_id"]) == (3, 4, 5)
    assert exported["max_position_embeddings"] == 4096
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "hf" / name).read_bytes() == (folder / name).read_bytes(), name
        assert report.copied[name] == str(folder)
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "hf").config.eos_token_id == 4
    own = tmp_path / "own"
    save_tokenizer(train_bpe(["the job's own tokenizer " * 50], 280), str(own))
    spec = spec.model_copy(update={"data": spec.data.model_copy(update={"tokenizer": str(own)})})
    report = export_hf(spec, str(tmp_path / "hf-own"))
    assert (tmp_path / "hf-own" / "tokenizer.json").read_bytes() != (folder / "tokenizer.json").read_bytes()
    assert json.loads((tmp_path / "hf-own" / "tokenizer.json").read_text())["model"]["type"] == "BPE"
    assert not (tmp_path / "hf-own" / "tokenizer_config.json").exists()  # the folder's belongs to its tokenizer
    assert (tmp_path / "hf-own" / "generation_config.json").exists()
