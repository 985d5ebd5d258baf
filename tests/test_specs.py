"""The job-spec language: examples validate, bad specs fail at the right FILE:LINE with a path."""

from __future__ import annotations

import json
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest
from parashift.specs import (
    JobSpec,
    ResourceChange,
    SpecError,
    SpecIssue,
    json_schema,
    load_spec,
    parse_spec,
)
from pydantic import ValidationError

from parashift import specs

REPO_ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((REPO_ROOT / "specs").glob("*.yaml"))
LINE = re.compile(r"^.+:\d+:\d+: [\w.()]+: .+$")


def errors_of(tmp_path: Path, text: str | bytes, name: str = "job.yaml") -> tuple[str, list[str]]:
    """Write `text` to a file, load it, and return (file, error lines); it must fail."""
    file = tmp_path / name
    if isinstance(text, bytes):
        file.write_bytes(text)
    else:
        file.write_text(text)
    with pytest.raises(SpecError) as caught:
        load_spec(file)
    lines = caught.value.lines()
    assert lines, "a SpecError carries at least one issue"
    for line in lines:
        assert LINE.match(line), line
        assert "Traceback" not in line
    return str(file), lines


def assert_error(lines: list[str], file: str, line: int, column: int, path: str, *words: str) -> None:
    prefix = f"{file}:{line}:{column}: {path}: "
    hits = [entry for entry in lines if entry.startswith(prefix)]
    assert hits, f"no error at {prefix!r} in {lines}"
    for word in words:
        assert any(word in hit for hit in hits), f"{word!r} not in {hits}"


# ---- examples --------------------------------------------------------------------------------


def test_examples_exist() -> None:
    names = {path.stem for path in EXAMPLES}
    assert {"default", "s3-example", "elastic-example", "gpt2-small-cuda"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda path: path.name)
def test_example_validates(path: Path) -> None:
    spec = load_spec(path)
    assert spec.job_id == spec.name


def test_default_example_is_the_default_job() -> None:
    spec = load_spec(specs.example_path("default"))
    assert spec.name == "tiny-gpt"
    assert spec.model.model_dump() == {
        "family": "gpt",
        "n_layers": 2,
        "d_model": 64,
        "n_heads": 4,
        "vocab_size": 256,
        "seq_len": 64,
        "dropout": 0.0,
    }
    assert (spec.data.url, spec.data.max_bytes) == ("builtin://python-stdlib", 2_000_000)
    opt = spec.optimizer
    assert (opt.lr, opt.min_lr, opt.warmup_steps, opt.schedule) == (1e-3, 1e-4, 10, "cosine")
    assert (opt.weight_decay, opt.grad_clip) == (0.1, 1.0)
    tr = spec.training
    assert (tr.global_batch, tr.micro_batch, tr.steps, tr.seed, tr.checkpoint_every) == (16, 4, 60, 1234, 20)
    assert (spec.resources.devices, spec.resources.kind) == (2, "cpu")
    assert spec.storage.url == "file://./parashift-store"
    assert spec.elasticity == []


def test_other_examples_say_what_they_promise() -> None:
    s3 = load_spec(specs.example_path("s3-example"))
    assert s3.storage.url.startswith("s3://") and "endpoint_url" in s3.storage.storage_options
    elastic = load_spec(specs.example_path("elastic-example"))
    assert elastic.resources.devices == 4
    assert [(c.at_step, c.devices, c.reason) for c in elastic.elasticity] == [
        (20, 2, "scale-down"),
        (40, 3, "scale-up"),
    ]
    gpt2 = load_spec(specs.example_path("gpt2-small-cuda"))
    assert (gpt2.model.n_layers, gpt2.model.d_model, gpt2.model.n_heads) == (12, 768, 12)
    assert (gpt2.model.vocab_size, gpt2.model.seq_len) == (50304, 1024)
    assert (gpt2.resources.kind, gpt2.resources.devices) == ("cuda", 1)
    assert (gpt2.parallelism.precision, gpt2.parallelism.compile) == ("bf16", True)
    assert (gpt2.training.global_batch, gpt2.training.micro_batch) == (16, 16)


def test_minimal_spec_takes_defaults_and_yaml12_floats(tmp_path: Path) -> None:
    text = "name: a.b_c-1\noptimizer:\n  lr: 6E-4\n  min_lr: 1e-5\n  eps: 1.0e8\nparallelism:\n"
    spec = parse_spec(text, "inline.yaml")
    assert spec == JobSpec(name="a.b_c-1", optimizer={"lr": 6e-4, "min_lr": 1e-5, "eps": 1e8})
    assert spec.optimizer.betas == (0.9, 0.95)
    assert spec.parallelism.strategy == "data-parallel"  # an empty section means its defaults


def test_non_secret_storage_options_are_fine() -> None:
    text = (
        "name: x\nstorage:\n  url: s3://bucket/runs\n  credentials_block: parashift-s3\n"
        "  storage_options:\n    endpoint_url: http://127.0.0.1:9000\n    anon: false\n"
        "    client_kwargs: {region_name: us-east-1}\n"
    )
    spec = parse_spec(text, "s3.yaml")
    assert spec.storage.credentials_block == "parashift-s3"


@pytest.mark.parametrize(
    "url",
    [
        "file:///data/*.txt",
        "s3://bucket/corpus/*.txt",
        "data/corpus.txt",
        "/abs/path.bin",
        "hf://datasets/x/y",
    ],
)
def test_good_data_urls(url: str) -> None:
    assert parse_spec(f"name: x\ndata:\n  url: '{url}'\n", "u.yaml").data.url == url


# ---- invalid specs: exact FILE:LINE:COL and field path ----------------------------------------


def test_wrong_type(tmp_path: Path) -> None:
    file, lines = errors_of(tmp_path, "name: x\ntraining:\n  steps: ten\n")
    assert_error(lines, file, 3, 10, "training.steps", "expected an integer", "'ten'")


def test_quoted_number_is_a_string(tmp_path: Path) -> None:
    file, lines = errors_of(tmp_path, "name: x\noptimizer:\n  lr: '1e-3'\n")
    assert_error(lines, file, 3, 7, "optimizer.lr", "expected a number", "without quotes")


def test_unknown_top_level_key_suggests(tmp_path: Path) -> None:
    file, lines = errors_of(tmp_path, "name: x\noptimiser:\n  lr: 0.1\n")
    assert_error(lines, file, 2, 1, "optimiser", "unknown key 'optimiser'", "did you mean 'optimizer'?")


def test_unknown_nested_key_suggests(tmp_path: Path) -> None:
    file, lines = errors_of(tmp_path, "name: x\nmodel:\n  n_layers: 2\n  dropot: 0.1\n")
    assert_error(lines, file, 4, 3, "model.dropot", "unknown key 'dropot'", "did you mean 'dropout'?")


def test_unknown_key_without_match_lists_keys(tmp_path: Path) -> None:
    file, lines = errors_of(tmp_path, "name: x\nresources:\n  zzz: 1\n")
    assert_error(lines, file, 3, 3, "resources.zzz", "expected one of: devices, kind")


def test_negative_batch(tmp_path: Path) -> None:
    file, lines = errors_of(tmp_path, "name: x\ntraining:\n  global_batch: -4\n")
    assert_error(lines, file, 3, 17, "training.global_batch", "greater than or equal to 1", "-4")


def test_indivisible_batch(tmp_path: Path) -> None:
    file, lines = errors_of(tmp_path, "name: x\ntraining:\n  global_batch: 16\n  micro_batch: 5\n")
    assert_error(
        lines, file, 4, 16, "training.micro_batch", "must be divisible by training.micro_batch (16 % 5 != 0)"
    )


def test_micro_batch_above_global_batch(tmp_path: Path) -> None:
    file, lines = errors_of(tmp_path, "name: x\ntraining: {global_batch: 4, micro_batch: 8}\n")
    assert_error(lines, file, 2, 42, "training.micro_batch", "must be <= training.global_batch (8 > 4)")


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("s3//bucket", "malformed URL scheme"),
        ("s3:/bucket", "write it as 's3://bucket'"),
        ("://x", "malformed URL scheme ''"),
        ("ht!tp://x", "malformed URL scheme 'ht!tp'"),
        ("ftp://host/x", "unsupported URL scheme 'ftp'"),
        ("", "must not be empty"),
        ("   ", "must not be empty"),
        ("a b.txt", "whitespace"),
        ("s3://", "names no location"),
        ("builtin://linux-kernel", "unknown built-in corpus"),
    ],
)
def test_bad_data_url(tmp_path: Path, url: str, words: str) -> None:
    file, lines = errors_of(tmp_path, f"name: x\ndata:\n  url: '{url}'\n")
    assert_error(lines, file, 3, 8, "data.url", words)


@pytest.mark.parametrize(
    ("url", "words"),
    [("https://example.com/store", "unsupported URL scheme 'https'"), ("s3://b/*", "not a glob")],
)
def test_bad_storage_url(tmp_path: Path, url: str, words: str) -> None:
    file, lines = errors_of(tmp_path, f"name: x\n\nstorage:\n    url: {url}\n")
    assert_error(lines, file, 4, 10, "storage.url", words)


def test_inline_credentials(tmp_path: Path) -> None:
    text = (
        "name: x\nstorage:\n  url: s3://b\n  storage_options:\n    endpoint_url: http://h\n    Secret: abc\n"
    )
    file, lines = errors_of(tmp_path, text)
    assert_error(
        lines,
        file,
        6,
        5,
        "storage.storage_options.Secret",
        "inline credential 'Secret'",
        "storage.credentials_block",
    )


def test_inline_credentials_nested(tmp_path: Path) -> None:
    text = (
        "name: x\ndata:\n  url: s3://b/*.txt\n  storage_options:\n    client_kwargs:\n"
        "      config: {retries: 3}\n      AWS_SECRET_ACCESS_KEY: abc\n"
    )
    file, lines = errors_of(tmp_path, text)
    path = "data.storage_options.client_kwargs.AWS_SECRET_ACCESS_KEY"
    assert_error(lines, file, 7, 7, path, "environment", "Prefect Secret block")


@pytest.mark.parametrize(
    ("name", "words"),
    [
        ("../x", "safe job id"),
        ("a/b", "safe job id"),
        ("Tiny-GPT", "safe job id"),
        ("a..b", "must not contain '..'"),
        ("''", "safe job id"),
        ("x" * 64, "at most 63"),
        ('"tiny\\n"', "safe job id"),  # a trailing newline
    ],
)
def test_bad_job_name(tmp_path: Path, name: str, words: str) -> None:
    file, lines = errors_of(tmp_path, f"# job\nname: {name}\n")
    assert_error(lines, file, 2, 7, "name", words)


@pytest.mark.parametrize(
    ("line", "field", "words"),
    [
        ("training: {steps: 1000000000000}", "training.steps", "less than or equal to 1000000000"),
        ("resources: {devices: 1000000000}", "resources.devices", "less than or equal to 65536"),
        ("model: {seq_len: 1000000000000}", "model.seq_len", "less than or equal to 1048576"),
        ("model: {d_model: 100000000}", "model.d_model", "less than or equal to 65536"),
        ("training: {global_batch: 1000000000000}", "training.global_batch", "less than or equal to 16777216"),
        ("optimizer: {lr: .inf}", "optimizer.lr", "finite"),
        ("resources: {memory_gb: .nan}", "resources.memory_gb", "finite"),
    ],
)
def test_numbers_no_machine_can_run_are_bounded(tmp_path: Path, line: str, field: str, words: str) -> None:
    file, lines = errors_of(tmp_path, f"name: big\n{line}\n")
    assert any(f"{field}:" in x and words in x for x in lines), lines


def test_missing_name(tmp_path: Path) -> None:
    file, lines = errors_of(tmp_path, "model:\n  n_layers: 2\n")
    assert_error(lines, file, 1, 1, "name", "missing required key 'name'")


def test_yaml_syntax_error(tmp_path: Path) -> None:
    file, lines = errors_of(tmp_path, "name: x\nmodel:\n  d_model: [64\n  n_heads: 4\n")
    assert len(lines) == 1
    assert lines[0].startswith(f"{file}:4:10: (root): YAML syntax error: ")


def test_tab_indentation(tmp_path: Path) -> None:
    file, lines = errors_of(tmp_path, "name: x\nmodel:\n\tn_layers: 2\n")
    assert_error(lines, file, 3, 1, "(root)", "tabs")


@pytest.mark.parametrize("text", ["", "\n\n", "# nothing here\n# at all\n"])
def test_empty_file(tmp_path: Path, text: str) -> None:
    file, lines = errors_of(tmp_path, text)
    assert lines == [f"{file}:1:1: (root): empty spec: expected a mapping with at least 'name'"]


def test_top_level_list(tmp_path: Path) -> None:
    file, lines = errors_of(tmp_path, "# a list\n- name: x\n")
    assert_error(lines, file, 2, 1, "(root)", "must be a mapping", "got a list")


def test_duplicate_key(tmp_path: Path) -> None:
    file, lines = errors_of(tmp_path, "name: x\ntraining:\n  steps: 10\n  seed: 1\n  steps: 20\n")
    assert lines == [f"{file}:5:3: training.steps: duplicate key 'steps' (first defined at line 3)"]


def test_heads_do_not_divide_width(tmp_path: Path) -> None:
    file, lines = errors_of(tmp_path, "name: x\nmodel:\n  d_model: 100\n  n_heads: 3\n")
    assert_error(lines, file, 3, 12, "model.d_model", "divisible by model.n_heads (100 % 3 != 0)")


def test_vocab_too_small_for_bytes(tmp_path: Path) -> None:
    file, lines = errors_of(tmp_path, "name: x\nmodel:\n  vocab_size: 100\n")
    assert_error(lines, file, 3, 15, "model.vocab_size", ">= 256")
    # token files bring their own vocabulary
    assert parse_spec("name: x\nmodel: {vocab_size: 100}\ndata: {format: tokens}\n", "t.yaml")


ELASTIC = """\
name: x
training:
  global_batch: 8
  steps: 60
  micro_batch: 4
elasticity:
  - at_step: 30
    devices: 2
  - at_step: {second_step}
    devices: {second_devices}
"""


def test_elasticity_out_of_order(tmp_path: Path) -> None:
    file, lines = errors_of(tmp_path, ELASTIC.format(second_step=20, second_devices=4))
    assert_error(lines, file, 9, 14, "elasticity.1.at_step", "greater than elasticity.0.at_step (20 <= 30)")


def test_elasticity_beyond_steps(tmp_path: Path) -> None:
    file, lines = errors_of(tmp_path, ELASTIC.format(second_step=60, second_devices=4))
    assert_error(lines, file, 9, 14, "elasticity.1.at_step", "must be < training.steps (60 >= 60)")


def test_elasticity_devices_above_global_batch(tmp_path: Path) -> None:
    file, lines = errors_of(tmp_path, ELASTIC.format(second_step=40, second_devices=9))
    assert_error(lines, file, 10, 14, "elasticity.1.devices", "<= training.global_batch (9 > 8)")


def test_elasticity_missing_field_points_at_entry(tmp_path: Path) -> None:
    file, lines = errors_of(
        tmp_path, "name: x\nelasticity:\n  - at_step: 5\n    devices: 2\n  - devices: 3\n"
    )
    assert_error(lines, file, 5, 5, "elasticity.1.at_step", "missing required key 'at_step'")


def test_start_devices_above_global_batch(tmp_path: Path) -> None:
    file, lines = errors_of(tmp_path, "name: x\nresources:\n  devices: 32\n")
    assert_error(lines, file, 3, 12, "resources.devices", "<= training.global_batch (32 > 16)")


def test_devices_outside_the_job_s_own_bounds(tmp_path: Path) -> None:
    """`min_devices: 4` with `devices: 2` was taken by `parashift run` without a word (it trained
    on 2); the start and every scripted count lie within min_devices..max_devices."""
    file, lines = errors_of(tmp_path, "name: x\nresources:\n  devices: 2\n  min_devices: 4\n")
    assert_error(lines, file, 3, 12, "resources.devices", "must be >= resources.min_devices (2 < 4)")
    file, lines = errors_of(tmp_path, "name: x\nresources:\n  devices: 6\n  max_devices: 4\n")
    assert_error(lines, file, 3, 12, "resources.devices", "must be <= resources.max_devices (6 > 4)")
    file, lines = errors_of(tmp_path, ELASTIC.format(second_step=40, second_devices=1) + "resources:\n  min_devices: 2\n")
    assert any("elasticity.1.devices: must be >= resources.min_devices (1 < 2)" in line for line in lines), lines


def test_min_lr_above_lr(tmp_path: Path) -> None:
    file, lines = errors_of(tmp_path, "name: x\noptimizer:\n  lr: 1e-3\n  min_lr: 1e-2\n")
    assert_error(lines, file, 4, 11, "optimizer.min_lr", "must be <= optimizer.lr (0.01 > 0.001)")


def test_mixed_precision_without_bf16_is_refused_not_ignored(tmp_path: Path) -> None:
    file, lines = errors_of(tmp_path, "name: x\nparallelism:\n  strategy: auto\n  mixed_precision: fsdp\n")
    assert_error(lines, file, 4, 20, "parallelism.mixed_precision", "'fsdp'", "precision: bf16")
    assert parse_spec("name: x\nparallelism: {precision: bf16, mixed_precision: fsdp}\n", "t.yaml")


def test_literal_with_suggestion_and_tuple_item(tmp_path: Path) -> None:
    file, lines = errors_of(tmp_path, "name: x\noptimizer:\n  schedule: cosin\n  betas: [0.9, 1.5]\n")
    assert_error(lines, file, 3, 13, "optimizer.schedule", "did you mean 'cosine'?")
    assert_error(lines, file, 4, 16, "optimizer.betas.1", "must be in [0, 1)")


def test_a_device_kind_said_as_people_say_it_is_suggested_by_meaning(tmp_path: Path) -> None:
    """`kind: gpu` was answered "did you mean 'cpu'?" (closest by spelling): the opposite."""
    file, lines = errors_of(tmp_path, "name: x\nresources:\n  kind: gpu\n")
    assert_error(lines, file, 3, 9, "resources.kind", "did you mean 'cuda'?")
    file, lines = errors_of(tmp_path, "name: x\nresources:\n  kind: GPU\n")
    assert_error(lines, file, 3, 9, "resources.kind", "did you mean 'cuda'?")


def test_section_of_wrong_kind(tmp_path: Path) -> None:
    file, lines = errors_of(tmp_path, "name: x\nmodel: 5\n")
    assert_error(lines, file, 2, 8, "model", "expected a mapping, got integer 5")


def test_several_errors_are_all_reported_in_order(tmp_path: Path) -> None:
    file, lines = errors_of(tmp_path, "name: X\nmodel:\n  n_layers: 0\ntraining:\n  seed: -1\n")
    assert [line.split(": ")[0] for line in lines] == [f"{file}:1:7", f"{file}:3:13", f"{file}:5:9"]


def test_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(SpecError) as caught:
        load_spec(missing)
    assert caught.value.lines() == [f"{missing}:1:1: (root): no such file"]


def test_non_utf8(tmp_path: Path) -> None:
    file, lines = errors_of(tmp_path, b"name: x\nmodel:\n  # caf\xe9\n")
    assert_error(lines, file, 3, 8, "(root)", "not valid UTF-8", "0xe9")


def test_unsafe_tag_is_refused(tmp_path: Path) -> None:
    file, lines = errors_of(tmp_path, "name: !!python/object/apply:os.system ['true']\n")
    assert_error(lines, file, 1, 7, "(root)", "YAML error")


# ---- the Python API ------------------------------------------------------------------------------


def test_spec_error_object() -> None:
    with pytest.raises(SpecError) as caught:
        parse_spec("name: x\ntraining: {steps: 0}\n", "inline.yaml")
    issue = caught.value.issues[0]
    assert issue == SpecIssue("inline.yaml", 2, 19, "training.steps", issue.message)
    assert str(caught.value) == "\n".join(caught.value.lines())
    copy = pickle.loads(pickle.dumps(caught.value))
    assert copy.lines() == caught.value.lines()


def test_models_validate_in_python_too() -> None:
    with pytest.raises(ValidationError, match="divisible"):
        JobSpec(name="x", training={"global_batch": 16, "micro_batch": 5})
    with pytest.raises(ValidationError, match="training.steps"):
        JobSpec(name="x", elasticity=[ResourceChange(at_step=100, devices=1)])
    with pytest.raises(ValidationError):
        JobSpec(name="x", unknown=1)
    spec = JobSpec(name="x", elasticity=[{"at_step": 5, "devices": 1, "reason": "failure"}])
    assert spec.job_id == "x" and spec.elasticity[0].reason == "failure"
    assert JobSpec.model_validate_json(spec.model_dump_json()) == spec


def test_json_schema() -> None:
    schema = json_schema()
    assert schema["$schema"].startswith("https://json-schema.org/")
    assert schema["title"]
    assert set(schema["properties"]) == {
        "name",
        "model",
        "data",
        "optimizer",
        "training",
        "resources",
        "parallelism",
        "storage",
        "metrics",
        "elasticity",
    }
    for name, definition in schema["$defs"].items():
        assert definition.get("description"), name
        for field, prop in definition["properties"].items():
            assert prop.get("description"), f"{name}.{field}"
    json.dumps(schema)


# ---- the real CLI ----------------------------------------------------------------------------------


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "parashift.cli", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_cli_validate_reports_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: ../x\noptimiser: {}\ntraining:\n  global_batch: 16\n  micro_batch: 5\n")
    syntax = tmp_path / "syntax.yaml"
    syntax.write_text("name: x\nmodel: [\n")
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    missing = tmp_path / "missing.yaml"
    result = run_cli("validate", str(bad), str(syntax), str(binary), str(missing))
    assert result.returncode == 1
    assert "Traceback" not in result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) >= 5
    for line in lines:
        assert LINE.match(line), line
    assert f"{bad}:1:7: name: " in result.stdout
    assert f"{bad}:2:1: optimiser: unknown key 'optimiser'; did you mean 'optimizer'?" in result.stdout
    assert f"{missing}:1:1: (root): no such file" in lines


def test_cli_validate_ok_and_schema() -> None:
    examples = [str(path.relative_to(REPO_ROOT)) for path in EXAMPLES]
    result = run_cli("validate", *examples)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines() == [f"{path}: ok" for path in examples]
    schema = run_cli("schema")
    assert schema.returncode == 0, schema.stderr
    assert "model" in json.loads(schema.stdout)["properties"]


def test_devices_follow_from_the_nodes(tmp_path: Path) -> None:
    """`nodes` and `devices_per_node` given, `devices` left out: it is their product (the
    example in docs/nodes.md); given and contradicting them, it is an error at its line."""
    good = tmp_path / "nodes.yaml"
    good.write_text("name: n\ntraining: {global_batch: 8, micro_batch: 2}\n"
                    "resources: {nodes: [a, b], devices_per_node: 2}\n")
    assert load_spec(good).resources.devices == 4
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: n\ntraining: {global_batch: 8, micro_batch: 2}\n"
                   "resources: {nodes: [a, b], devices_per_node: 2, devices: 2}\n")
    with pytest.raises(SpecError, match=r"bad.yaml:3:.*resources.devices: must be nodes x devices_per_node"):
        load_spec(bad)


@pytest.mark.parametrize("args", [[], ["tokenizer"]])
def test_help_lists_each_command_by_its_first_sentence_on_one_line(args: list[str]) -> None:
    """`parashift --help` (and a group's) lists each command by a whole first sentence: wide
    enough, one line each (Typer showed a docstring's first paragraph with its line breaks,
    `(twice:` on one line and `at once).` on the next)."""
    from typer.testing import CliRunner

    from parashift.cli import app

    shown = CliRunner().invoke(app, [*args, "--help"], env={"COLUMNS": "240", "TERM": "dumb"})
    assert shown.exit_code == 0, shown.output
    panel = shown.output.split("Commands")[1].splitlines()[1:]
    rows = [line.strip("│ ").strip() for line in panel if line.startswith("│")]
    assert rows and all(re.match(r"^[a-z-]+ {2,}\S.*\.$", row) for row in rows), rows
