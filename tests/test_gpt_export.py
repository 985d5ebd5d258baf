"""`parashift export` of the GPT family (the default model): a checkpoint written under tensor
parallelism becomes an OPT checkpoint that `transformers` loads and computes the same logits
from (models/gpt/hf.py). No worker process: the ranks' saves are made in this one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from parashift.models import family_of
from parashift.models.gpt.hf import hf_name
from parashift.specs import JobSpec
from parashift.specs.plan import Plan
from parashift.storage import job_store
from parashift.trainer.export import export_hf
from parashift.trainer.layout import state_layout
from states import global_state, save_all_ranks

# Uneven on purpose (vocab 261 over tp 2), dropout 0: a model to compare.
MODEL = {"family": "gpt", "n_layers": 2, "d_model": 60, "n_heads": 6, "vocab_size": 261, "seq_len": 24}


def test_a_gpt_checkpoint_exports_to_opt_with_transformers_logits(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    spec = JobSpec.model_validate({"name": "gpt-out", "model": MODEL, "storage": {"url": f"file://{tmp_path}/store"}})
    layout = state_layout(Plan(devices=4, mesh={"dp": 2, "tp": 2}), spec.model)
    state = global_state(layout)
    draw = torch.Generator().manual_seed(5)
    for name in state:
        if name.startswith("model/"):  # weights a model computes sensibly with, distinct everywhere
            state[name] = torch.randn(state[name].shape, generator=draw) * 0.2
    save_all_ranks(job_store(spec), layout, state, step=7)

    report = export_hf(spec, str(tmp_path / "hf"), max_shard_bytes=100_000)
    assert report.step == 7 and len(report.files) > 2  # several shards and their index
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["OPTForCausalLM"] and not config["tie_word_embeddings"]

    family = family_of(spec.model)
    ours = family.build(spec.model)
    with torch.no_grad():
        for name, param in ours.named_parameters():
            param.copy_(state[f"model/{name}"])
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32, attn_implementation="sdpa").eval()
    assert sum(p.numel() for p in theirs.parameters()) == sum(p.numel() for p in ours.parameters()) + 2 * 60
    tokens = torch.randint(0, 261, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got, expected = theirs(tokens).logits, ours(tokens)
    assert torch.allclose(got, expected, rtol=0, atol=1e-5), (got - expected).abs().max()

    # Exported again into the same folder, in one file and then in shards: only this export's
    # weight files stay (a single file left beside a newer sharded export is what transformers
    # loads: the old weights, silently); other files are left alone.
    (tmp_path / "hf" / "README.md").write_text("mine")

    def weight_files() -> set[str]:
        return {p.name for p in (tmp_path / "hf").iterdir() if "safetensors" in p.name}

    export_hf(spec, str(tmp_path / "hf"))
    assert weight_files() == {"model.safetensors"}
    export_hf(spec, str(tmp_path / "hf"), max_shard_bytes=100_000)
    assert "model.safetensors" not in weight_files() and "model.safetensors.index.json" in weight_files()
    assert (tmp_path / "hf" / "README.md").read_text() == "mine"

    # In bf16 (`parashift export --dtype bfloat16`): half the bytes, the config says so, and
    # transformers loads the fp32 weights rounded once, no other change.
    half = export_hf(spec, str(tmp_path / "hf16"), dtype="bfloat16")
    assert half.bytes_written < 0.6 * export_hf(spec, str(tmp_path / "hf32")).bytes_written
    assert json.loads((tmp_path / "hf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    rounded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf16", dtype="auto")
    full = AutoModelForCausalLM.from_pretrained(tmp_path / "hf32", dtype="auto")
    for (name, got), (_, want) in zip(rounded.state_dict().items(), full.state_dict().items(), strict=True):
        assert got.dtype == torch.bfloat16 and want.dtype == torch.float32, name
        assert torch.equal(got, want.to(torch.bfloat16)), name
    with pytest.raises(ValueError, match="float8"):
        export_hf(spec, str(tmp_path / "no"), dtype="float8")


def test_every_gpt_parameter_has_one_opt_name() -> None:
    spec = JobSpec.model_validate({"name": "names", "model": MODEL}).model
    names = [name for name, _ in family_of(spec).build(spec).named_parameters()]
    mapped = [hf_name(name)[0] for name in names]
    assert len(set(mapped)) == len(names)
    with pytest.raises(KeyError):
        hf_name("blocks.0.attn.rotary")
