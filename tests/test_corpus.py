"""The data room: tokenizers trained offline and loaded as `transformers` does, prepared token
shards read back exactly (across shard edges, on file:// and s3://), and every bad input
refused in one line before training starts."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from parashift.corpus import (
    DatasetError,
    PrepareOptions,
    Tokenizer,
    load_tokenizer,
    open_dataset,
    prepare_dataset,
)
from parashift.corpus.dataset import MANIFEST_KEY, DatasetManifest, encode_dataset_manifest
from parashift.corpus.tokenizer import BYTES_TOKENIZER
from parashift.specs import JobSpec
from parashift.tasks.preflight import check_data
from parashift.trainer.data import InMemoryTokens, SampleStream
from typer.testing import CliRunner

from parashift.cli import app

SAMPLE = "def greet(name):\n    return f'hello, {name}!'  # ünïcode too\n"


def write_corpus(folder: Path, files: int = 5) -> Path:
    """A few small Python-ish documents and a JSONL file of more."""
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(files):
        (folder / f"doc{i}.txt").write_text((SAMPLE * (i + 1)).replace("name", f"name{i}") * 20)
    (folder / "more.jsonl").write_text("\n".join(json.dumps({"text": f"line {i}: {SAMPLE}", "id": i})
                                                 for i in range(50)))
    return folder


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`parashift tokenizer train` on the corpus: the tokenizer.json it writes."""
    root = tmp_path_factory.mktemp("tok")
    corpus = write_corpus(root / "corpus")
    out = CliRunner().invoke(app, ["tokenizer", "train", str(corpus), str(root / "tok"), "--vocab-size", "400"])
    assert out.exit_code == 0, out.output
    return root / "tok" / "tokenizer.json"


def test_a_trained_tokenizer_loads_in_transformers_and_the_reader_yields_its_ids(trained: Path, tmp_path: Path) -> None:
    from tokenizers import Tokenizer as HFTokenizer
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_file=str(trained))
    plain = HFTokenizer.from_file(str(trained))
    want = fast.encode(SAMPLE, add_special_tokens=False)
    assert want == plain.encode(SAMPLE, add_special_tokens=False).ids and len(want) < len(SAMPLE.encode())
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "sample.txt").write_text(SAMPLE)
    out = CliRunner().invoke(app, ["prepare-data", str(tmp_path / "in"), str(tmp_path / "ds"), "--tokenizer",
                                   str(trained.parent)])
    assert out.exit_code == 0, out.output
    dataset = open_dataset(str(tmp_path / "ds"))
    eos = fast.convert_tokens_to_ids("<|endoftext|>")
    assert dataset.read_many([(0, len(dataset))])[0].tolist() == want + [eos]
    assert fast.decode(want) == SAMPLE


def test_the_commands_reach_an_s3_compatible_server_through_storage_options(tmp_path: Path, s3_endpoint: str,
                                                                           s3_bucket: str) -> None:
    """`tokenizer train` and `prepare-data` on a MinIO-like server: the engine took storage
    options but the commands had no way to give them (an endpoint was asked of AWS: 35 s of
    retries, then a traceback). Now `--storage-options` (JSON, as a spec's storage_options)
    reaches inputs, tokenizer and output, and bad JSON is refused naming the flag."""
    import fsspec

    options = {"client_kwargs": {"endpoint_url": s3_endpoint}}
    fs = fsspec.filesystem("s3", **options)
    corpus = write_corpus(tmp_path / "corpus", files=2)
    fs.put(f"{corpus}/", f"{s3_bucket}/raw/", recursive=True)
    runner, flag = CliRunner(), ["--storage-options", json.dumps(options)]
    out = runner.invoke(app, ["tokenizer", "train", f"s3://{s3_bucket}/raw", f"s3://{s3_bucket}/tok", "--vocab-size",
                              "300", *flag])
    assert out.exit_code == 0, out.output
    out = runner.invoke(app, ["prepare-data", f"s3://{s3_bucket}/raw/*.txt", f"s3://{s3_bucket}/ds", "--tokenizer",
                              f"s3://{s3_bucket}/tok", *flag])
    assert out.exit_code == 0 and "2 documents" in out.output, out.output
    tokenizer = load_tokenizer(f"s3://{s3_bucket}/tok", options)
    texts = [p.read_text() for p in sorted(corpus.glob("*.txt"))]
    want = [i for ids in tokenizer.encode_batch(texts) for i in [*ids, tokenizer.eos_id]]
    dataset = open_dataset(f"s3://{s3_bucket}/ds", options)
    assert dataset.read_many([(0, len(dataset))])[0].tolist() == want
    for bad, said in (("{endpoint", "not JSON"), ("[1]", "a JSON object of fsspec options is needed")):
        out = runner.invoke(app, ["prepare-data", str(corpus), str(tmp_path / "x"), "--storage-options", bad])
        assert out.exit_code == 2 and f"--storage-options: {said}" in out.output, out.output


@pytest.mark.parametrize("where", ["file", "s3"])
def test_prepared_shards_read_back_exactly_across_shard_edges(trained: Path, tmp_path: Path, where: str,
                                                              request: pytest.FixtureRequest) -> None:
    """Many shards (one per file), ranges that cross their edges: the tokens are the
    documents' encodings, each followed by the end-of-document id, in input order."""
    corpus = write_corpus(tmp_path / "corpus")
    tokenizer = load_tokenizer(str(trained))
    if where == "s3":
        bucket, endpoint = request.getfixturevalue("s3_bucket"), request.getfixturevalue("s3_endpoint")
        url, options = f"s3://{bucket}/dataset", {"client_kwargs": {"endpoint_url": endpoint}}
    else:
        url, options = f"file://{tmp_path}/dataset", {}
    manifest = prepare_dataset(f"file://{corpus}", url, tokenizer, group_bytes=1, out_options=options)
    assert len(manifest.shards) == 6 and manifest.dtype == "uint16"
    texts = [p.read_text() for p in sorted(corpus.glob("*.txt"))] + [
        json.loads(line)["text"] for line in (corpus / "more.jsonl").read_text().splitlines()]
    want = np.concatenate([np.asarray(ids + [tokenizer.eos_id]) for ids in tokenizer.encode_batch(texts)])
    dataset = open_dataset(url, options)
    assert len(dataset) == len(want) == manifest.tokens and manifest.documents == 55
    edges = np.cumsum([s.tokens for s in manifest.shards])[:-1]
    ranges = [(0, len(want)), *[(int(e) - 3, int(e) + 4) for e in edges], (len(want) - 1, len(want))]
    for (start, end), got in zip(ranges, dataset.read_many(ranges), strict=True):
        assert got.tolist() == want[start:end].tolist(), (start, end)


def test_parquet_rows_and_jsonl_lines_are_documents(trained: Path, tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [f"row {i}: {SAMPLE}" for i in range(30)]
    (tmp_path / "in").mkdir()
    pq.write_table(pa.table({"body": rows, "n": list(range(30))}), tmp_path / "in" / "a.parquet")
    (tmp_path / "in" / "b.jsonl").write_text("\n".join(json.dumps({"body": r}) for r in rows[:5]) + "\n\n")
    tokenizer = load_tokenizer(str(trained))
    manifest = prepare_dataset(f"file://{tmp_path}/in", f"file://{tmp_path}/ds", tokenizer,
                               PrepareOptions(text_field="body"))
    assert manifest.documents == 35
    want = [t for ids in tokenizer.encode_batch(rows + rows[:5]) for t in ids + [tokenizer.eos_id]]
    assert open_dataset(f"file://{tmp_path}/ds").read_many([(0, manifest.tokens)])[0].tolist() == want
    ends = np.frombuffer((tmp_path / "ds" / manifest.shards[0].docs_key).read_bytes(), "<u8")
    assert ends[-1] == manifest.tokens and len(ends) == 35


def test_a_parquet_input_without_the_text_column_is_named_with_its_columns(tmp_path: Path) -> None:
    """Not pyarrow's traceback ("No match for FieldRef.Name(text)"): the file, the column asked
    for, the columns it has; a file that is not Parquet is said to be so."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from parashift.corpus.documents import InputError, documents

    pq.write_table(pa.table({"content": ["a row"]}), tmp_path / "a.parquet")
    raw = (tmp_path / "a.parquet").read_bytes()
    with pytest.raises(InputError, match=r"a\.parquet: no column 'text' \(columns: content\); .*--text-field"):
        list(documents(f"file://{tmp_path}/a.parquet", raw, "parquet"))
    assert list(documents("a.parquet", raw, "parquet", "content")) == ["a row"]
    with pytest.raises(InputError, match="b.parquet: not a Parquet file"):
        list(documents("b.parquet", b"garbage", "parquet"))


def test_a_vocabulary_beyond_uint16_is_stored_as_uint32(tmp_path: Path) -> None:
    wide = Tokenizer("wide", 128_256, None, "sha256:wide")  # encodes bytes, claims Llama 3's vocabulary
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("abc" * 100)
    manifest = prepare_dataset(f"file://{tmp_path}/in", f"file://{tmp_path}/ds", wide)
    assert manifest.dtype == "uint32"
    assert (tmp_path / "ds/shards" / f"{manifest.shards[0].id}.tokens").stat().st_size == 300 * 4
    assert open_dataset(f"file://{tmp_path}/ds").read_many([(0, 3)])[0].tolist() == [97, 98, 99]


def test_preparing_again_writes_no_shard_and_the_stream_is_the_in_memory_one(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "corpus")
    written: list[bool] = []
    first = prepare_dataset(f"file://{corpus}", f"file://{tmp_path}/ds", BYTES_TOKENIZER, group_bytes=1,
                            on_shard=lambda record, new: written.append(new))
    again = prepare_dataset(f"file://{corpus}", f"file://{tmp_path}/ds", BYTES_TOKENIZER, group_bytes=1,
                            on_shard=lambda record, new: written.append(new))
    assert written == [True] * 6 + [False] * 6 and again.shards == first.shards
    dataset = open_dataset(f"file://{tmp_path}/ds")
    held = dataset.read_many([(0, len(dataset))])[0]
    streamed, in_memory = SampleStream(dataset, 16, seed=3), SampleStream(InMemoryTokens(held), 16, seed=3)
    for start in (0, 5, streamed.samples_per_epoch - 2):  # the last crosses into the next epoch
        assert all((a == b).all() for a, b in zip(streamed.batch(start, 4), in_memory.batch(start, 4), strict=True))


# ---------------------------------------------------------------- bad input, one line each


@pytest.fixture
def prepared(tmp_path: Path) -> tuple[Path, DatasetManifest]:
    corpus = write_corpus(tmp_path / "corpus", files=2)
    return tmp_path / "ds", prepare_dataset(f"file://{corpus}", f"file://{tmp_path}/ds", BYTES_TOKENIZER,
                                            group_bytes=1)


def job(url: Path | str, **data: object) -> JobSpec:
    return JobSpec.model_validate({"name": "data-job", "model": {"n_layers": 1, "d_model": 32, "n_heads": 2,
                                                                  "vocab_size": 256, "seq_len": 32},
                                   "data": {"url": str(url), "format": "prepared", **data},
                                   "storage": {"url": "file:///tmp/unused"}})


def one_line(spec: JobSpec) -> str:
    problems = check_data(spec)
    assert len(problems) == 1, problems
    assert "\n" not in str(problems[0])
    return str(problems[0])


def test_a_healthy_dataset_passes(prepared: tuple[Path, DatasetManifest]) -> None:
    assert check_data(job(prepared[0])) == []


def test_a_missing_shard_is_refused(prepared: tuple[Path, DatasetManifest]) -> None:
    folder, manifest = prepared
    (folder / manifest.shards[1].tokens_key).unlink()
    assert one_line(job(folder)).startswith(f"data.url: file://{folder}/shards/{manifest.shards[1].id}.tokens: missing")


def test_a_damaged_shard_is_refused_by_its_checksum_never_read(prepared: tuple[Path, DatasetManifest]) -> None:
    folder, manifest = prepared
    path = folder / manifest.shards[0].tokens_key
    raw = bytearray(path.read_bytes())
    raw[10] ^= 0xFF
    path.write_bytes(bytes(raw))
    dataset = open_dataset(str(folder))  # sizes agree: opening cannot tell, the first read does
    with pytest.raises(DatasetError, match=r"chunk 0 \(bytes 0\.\.\.\) fails its checksum"):
        dataset.read_many([(12, 20)])


def test_a_shard_dtype_that_cannot_hold_the_vocabulary_is_refused(prepared: tuple[Path, DatasetManifest]) -> None:
    folder, manifest = prepared
    tokenizer = manifest.tokenizer.model_copy(update={"vocab_size": 128_256})
    (folder / MANIFEST_KEY).write_bytes(encode_dataset_manifest(manifest.model_copy(update={"tokenizer": tokenizer})))
    assert "dtype uint16 cannot hold the tokenizer's 128256 ids" in one_line(job(folder))


def test_a_changed_manifest_is_refused_by_its_digest(prepared: tuple[Path, DatasetManifest]) -> None:
    folder, _ = prepared
    text = (folder / MANIFEST_KEY).read_text()
    (folder / MANIFEST_KEY).write_text(text.replace('"documents": 52', '"documents": 53'))
    assert "digest does not match" in one_line(job(folder))


def test_a_dataset_prepared_with_another_tokenizer_is_refused(prepared: tuple[Path, DatasetManifest],
                                                              trained: Path) -> None:
    message = one_line(job(prepared[0], tokenizer=str(trained)))
    assert message.startswith("data.tokenizer: ") and "was prepared with another tokenizer (bytes" in message


def test_a_model_vocabulary_smaller_than_the_tokenizer_s_is_refused(trained: Path, tmp_path: Path) -> None:
    spec = job(trained.parent, format="text", tokenizer=str(trained)).model_copy()
    spec = JobSpec.model_validate({**spec.model_dump(), "data": {**spec.data.model_dump(), "url": str(trained)}})
    spec = JobSpec.model_validate({**spec.model_dump(), "model": {**spec.model.model_dump(), "vocab_size": 300}})
    assert one_line(spec).startswith("model.vocab_size: 300 ids cannot embed the tokenizer")


def test_an_empty_corpus_is_refused(tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "empty.txt").write_text("")
    with pytest.raises(DatasetError, match="empty corpus"):
        prepare_dataset(f"file://{tmp_path}/in", f"file://{tmp_path}/ds", BYTES_TOKENIZER)
    out = CliRunner().invoke(app, ["prepare-data", str(tmp_path / "in"), str(tmp_path / "ds")])
    assert out.exit_code == 1 and "empty corpus" in out.output


def test_not_a_dataset_is_refused(tmp_path: Path) -> None:
    assert one_line(job(tmp_path)).startswith(f"data.url: no prepared dataset at {tmp_path}")


def test_a_tokenizer_that_is_not_one_is_refused(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text('{"not": "a tokenizer"}')
    spec = JobSpec.model_validate({"name": "j", "data": {"tokenizer": str(tmp_path)},
                                   "storage": {"url": "file:///tmp/unused"}})
    assert one_line(spec).startswith(f"data.tokenizer: {tmp_path}/tokenizer.json is not a tokenizers tokenizer.json")


def test_windows_within_documents_never_cross_an_end(tmp_path: Path) -> None:
    from parashift.trainer.data import windows_within

    rng = np.random.default_rng(0)
    ends = np.cumsum(rng.integers(1, 60, 200))
    brute = [s for b, e in zip(np.concatenate([[0], ends[:-1]]), ends, strict=True)
             for s in range(int(b), int(e) - 16, 16)]  # windows of 17 tokens, stride 16
    assert windows_within(ends, 16).tolist() == brute
    corpus = write_corpus(tmp_path / "corpus")
    prepare_dataset(f"file://{corpus}", f"file://{tmp_path}/ds", BYTES_TOKENIZER, group_bytes=1)
    dataset = open_dataset(f"file://{tmp_path}/ds")
    doc_ends = dataset.document_ends()
    assert len(doc_ends) == 55 and doc_ends[-1] == len(dataset)
    stream = SampleStream(dataset, 16, seed=3, document_ends=doc_ends)
    assert stream.samples_per_epoch == len(windows_within(doc_ends, 16)) < SampleStream(dataset, 16, 3).samples_per_epoch
    ids = stream.sample_ids(0, stream.samples_per_epoch)
    for (_, i), row in zip(ids, stream.windows(ids), strict=True):
        start = int(stream.starts[i])
        end = doc_ends[np.searchsorted(doc_ends, start, side="right")]
        assert start + 17 <= end and row.tolist() == dataset.read_many([(start, start + 17)])[0].tolist()


def test_workers_train_within_documents_alike_on_any_device_count(tmp_path: Path) -> None:
    """A job on a prepared dataset with `samples: documents`: the same losses on 1 and 3
    workers (the global order does not depend on the device count)."""
    from jobs import run, tiny_spec
    from parashift.specs.plan import Plan

    corpus = write_corpus(tmp_path / "corpus")
    prepare_dataset(f"file://{corpus}", f"file://{tmp_path}/ds", BYTES_TOKENIZER, group_bytes=1)
    data = {"url": f"file://{tmp_path}/ds", "format": "prepared", "samples": "documents"}
    losses = []
    for devices in (1, 3):
        spec = tiny_spec(f"documents-{devices}", f"file://{tmp_path}/store", data=data, training={"steps": 4},
                         resources={"devices": devices})
        losses.append([e.loss for e in run(spec, Plan.data_parallel(devices)).steps])
    assert len(losses[0]) == 4 and losses[0] == pytest.approx(losses[1], rel=1e-5)


def test_a_damaged_shard_stops_training_in_one_line_when_a_worker_reads_it(tmp_path: Path) -> None:
    """Opening a dataset reads no shard; the first worker to read a damaged chunk says which,
    once, and the job ends (fatal: no retry reads other bytes), never training on it."""
    from jobs import tiny_spec
    from parashift.launcher.launch import launch_workers
    from parashift.specs.plan import Plan

    corpus = write_corpus(tmp_path / "corpus", files=1)
    manifest = prepare_dataset(f"file://{corpus}", f"file://{tmp_path}/ds", BYTES_TOKENIZER)
    path = tmp_path / "ds" / manifest.shards[0].tokens_key
    raw = bytearray(path.read_bytes())
    for i in range(0, len(raw), 4096):  # every chunk: whatever the order reads first is damaged
        raw[i] ^= 0x55
    path.write_bytes(bytes(raw))
    spec = tiny_spec("damaged", f"file://{tmp_path}/store", data={"url": f"file://{tmp_path}/ds", "format": "prepared"},
                     training={"steps": 4})
    result = launch_workers(spec, Plan.data_parallel(2))
    assert result.returncode != 0 and not result.steps
    assert result.fatal is not None and "fails its checksum" in result.fatal.message
    assert result.fatal.message.startswith(f"data: file://{tmp_path}/ds/shards/{manifest.shards[0].id}.tokens: chunk ")
