"""`parashift prepare-data INPUTS OUTPUT`: text files (a URL or glob) into a prepared token
dataset (corpus.prepare); `parashift tokenizer train CORPUS OUT`: a byte-level BPE trained
offline. Both import their engine lazily (`tokenizers` only when it is used)."""

from __future__ import annotations

import json
import time
from typing import Any

import typer

tokenizer_app = typer.Typer(help="Tokenizers: train one offline.", no_args_is_help=True)

_OPTIONS_HELP = ("fsspec storage options as JSON, as a spec's storage_options, e.g. "
                 "'{\"client_kwargs\": {\"endpoint_url\": \"http://127.0.0.1:9000\"}}' for MinIO")


def storage_options_from(raw: str | None, flag: str) -> dict[str, Any] | None:
    """A flag's JSON object of fsspec options; a clear error (exit 2) for anything else."""
    if raw is None:
        return None
    try:
        options = json.loads(raw)
    except json.JSONDecodeError as error:
        typer.echo(f"{flag}: not JSON ({error.msg} at column {error.colno}): {raw}", err=True)
        raise typer.Exit(2) from None
    if not isinstance(options, dict):
        typer.echo(f"{flag}: a JSON object of fsspec options is needed, not {raw}", err=True)
        raise typer.Exit(2)
    return options


def prepare_data(
    inputs: str = typer.Argument(..., help="text files: a URL, folder or glob (file://, s3://, ... or a path)"),
    output: str = typer.Argument(..., help="the dataset folder to write (URL or path)"),
    tokenizer: str = typer.Option("bytes", "--tokenizer", help="'bytes', or a tokenizer.json (or a folder with one)"),
    text_format: str = typer.Option("auto", "--format", help="auto (by extension), text, jsonl or parquet"),
    text_field: str = typer.Option("text", "--text-field", help="the JSONL field or Parquet column of the text"),
    group_mb: float = typer.Option(256.0, "--group-mb", min=0.001, help="input MB per shard"),
    storage_options: str | None = typer.Option(None, "--storage-options",
                                               help=f"the inputs' and the tokenizer's (and the output's): {_OPTIONS_HELP}"),
    output_options: str | None = typer.Option(None, "--output-options",
                                              help="the output's storage options as JSON, where they differ"),
) -> None:
    """Tokenize the inputs into token shards with checksums and a manifest. Idempotent: shards
    already prepared from the same inputs with the same tokenizer are kept, not redone."""
    from parashift.corpus import DatasetError, PrepareOptions, TokenizerError, load_tokenizer, prepare_dataset
    from parashift.corpus.documents import FORMATS, InputError
    from parashift.storage import StorageError

    if text_format not in FORMATS:
        typer.echo(f"--format {text_format!r}: one of {', '.join(FORMATS)}", err=True)
        raise typer.Exit(2)
    options = storage_options_from(storage_options, "--storage-options")
    out_options = storage_options_from(output_options, "--output-options")
    out_options = options if out_options is None else out_options
    started = time.perf_counter()
    counts = {"written": 0, "kept": 0}

    def on_shard(record, written: bool) -> None:  # noqa: ANN001 - corpus.dataset.ShardRecord
        counts["written" if written else "kept"] += 1
        typer.echo(f"shard {record.id}: {record.tokens} tokens from {len(record.inputs)} files "
                   f"({'written' if written else 'already there'})")

    try:
        loaded = load_tokenizer(tokenizer, options)
        manifest = prepare_dataset(inputs, output, loaded, PrepareOptions(text_format, text_field), options,
                                   out_options, group_bytes=max(1, int(group_mb * 2**20)), on_shard=on_shard)
    except (DatasetError, TokenizerError, InputError, FileNotFoundError, StorageError) as error:
        typer.echo(f"cannot prepare {inputs}: {error}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"prepared {output}: {manifest.tokens} tokens ({manifest.dtype}), {manifest.documents} documents, "
               f"{len(manifest.shards)} shards ({counts['written']} written, {counts['kept']} kept) "
               f"in {time.perf_counter() - started:.1f} s")


@tokenizer_app.command("train")
def train_tokenizer(
    corpus: str = typer.Argument(..., help="text files to learn from: a URL, folder or glob"),
    output: str = typer.Argument(..., help="where to write tokenizer.json (a .json path or a folder)"),
    vocab_size: int = typer.Option(8192, "--vocab-size", min=257, help="ids, including <|endoftext|>"),
    text_format: str = typer.Option("auto", "--format", help="auto (by extension), text, jsonl or parquet"),
    text_field: str = typer.Option("text", "--text-field", help="the JSONL field or Parquet column of the text"),
    storage_options: str | None = typer.Option(None, "--storage-options", help=f"the corpus's and the output's: {_OPTIONS_HELP}"),
) -> None:
    """Train a byte-level BPE (GPT-2's pre-tokenization, <|endoftext|> as end of document) on
    the corpus; nothing is downloaded. It loads in `tokenizers` and `transformers`."""
    from parashift.corpus import TokenizerError, train_bpe
    from parashift.corpus.documents import InputError, documents, expand_inputs, format_of, read_input
    from parashift.corpus.tokenizer import save_tokenizer
    from parashift.storage import StorageError

    options = storage_options_from(storage_options, "--storage-options")

    def texts():  # noqa: ANN202 - a generator of the corpus's documents
        for url in expand_inputs(corpus, options):
            file, raw = read_input(url, options)
            yield from documents(url, raw, format_of(url, text_format), text_field)

    try:
        if not expand_inputs(corpus, options):
            raise FileNotFoundError(f"{corpus} matches no files")
        trained = train_bpe(texts(), vocab_size)
        written = save_tokenizer(trained, output, options)
    except (TokenizerError, InputError, FileNotFoundError, StorageError) as error:
        typer.echo(f"cannot train a tokenizer on {corpus}: {error}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"trained a byte-level BPE of {trained.vocab_size} ids ({trained.fingerprint[:19]}) -> {written}")
