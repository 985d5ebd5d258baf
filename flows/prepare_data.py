"""prepare_data: text files in, a prepared token dataset out (corpus.prepare as Prefect tasks).

    plan groups (list the inputs, check the tokenizer) ->
    prepare-shard per group, concurrently (read, tokenize, checksum, write; retried) ->
    write-manifest (the shards in input order) -> summary (tokens; shards written / already there)

Deployed as `prepare-data/prepare-data` (prefect.yaml); `parashift prepare-data` runs the same
steps in one process. Idempotent and resumable: a shard is named by its inputs' sha256 and the
tokenizer's fingerprint, and one already in the output is kept, so a run that failed part way
(or a rerun on the same inputs) redoes only the shards that are missing, then the manifest.

Groups run at once on the flow's task runner (threads, CONCURRENT_GROUPS of them: a group holds
its inputs and tokens in memory while it is prepared, and `tokenizers` encodes a batch on every
core already); `prepare_data.with_options(task_runner=...)` runs them elsewhere. Each task loads
the tokenizer from its reference itself: a `tokenizers` object does not travel between tasks.
"""

from __future__ import annotations

from typing import Any, Literal

from parashift.corpus import DatasetManifest, PrepareOptions, load_tokenizer
from parashift.corpus.dataset import MANIFEST_KEY, ShardRecord
from parashift.corpus.prepare import plan_groups, prepare_group, write_manifest
from parashift.storage import ObjectStore
from parashift.tasks.retry import retry_if_it_may_help
from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from prefect.futures import as_completed
from prefect.logging import get_run_logger
from prefect.task_runners import ThreadPoolTaskRunner

# Groups prepared at once: each holds up to a few times its input bytes in memory.
CONCURRENT_GROUPS = 4


@task(name="plan-groups", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2,
      retry_condition_fn=retry_if_it_may_help)
def plan_input_groups(inputs: str, tokenizer: str, storage_options: dict[str, Any] | None,
                      group_bytes: int) -> list[list[str]]:
    """The groups of input files, one shard each (sizes from a listing; nothing read). The
    tokenizer is loaded once here too, so a wrong reference fails the run before any group."""
    loaded = load_tokenizer(tokenizer, storage_options)
    groups = plan_groups(inputs, storage_options, group_bytes)
    get_run_logger().info("%s: %d files in %d groups; tokenizer %s (%d ids)", inputs, sum(map(len, groups)),
                          len(groups), loaded.name, loaded.vocab_size)
    return groups


@task(name="prepare-shard", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2,
      retry_condition_fn=retry_if_it_may_help)
def prepare_shard(urls: list[str], output: str, tokenizer: str, options: PrepareOptions,
                  storage_options: dict[str, Any] | None,
                  output_options: dict[str, Any] | None) -> tuple[ShardRecord, bool]:
    """The shard of one group of input files: (its record, whether it was written now rather
    than found from an earlier run)."""
    return prepare_group(urls, output, load_tokenizer(tokenizer, storage_options), options, storage_options,
                         output_options)


@task(name="write-manifest", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2,
      retry_condition_fn=retry_if_it_may_help)
def write_dataset_manifest(output: str, tokenizer: str, shards: list[ShardRecord], options: PrepareOptions,
                           storage_options: dict[str, Any] | None,
                           output_options: dict[str, Any] | None) -> DatasetManifest:
    """The dataset's manifest over the shards, in input order: written last, what makes the
    dataset readable."""
    return write_manifest(output, load_tokenizer(tokenizer, storage_options), shards, options, output_options)


@flow(name="prepare-data", task_runner=ThreadPoolTaskRunner(max_workers=CONCURRENT_GROUPS))
def prepare_data(inputs: str, output: str, tokenizer: str = "bytes",
                 text_format: Literal["auto", "text", "jsonl", "parquet"] = "auto", text_field: str = "text",
                 group_mb: float = 256, storage_options: dict[str, Any] | None = None,
                 output_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Tokenize the files `inputs` names (a URL, folder or glob) into token shards of about
    `group_mb` MiB of input each, with checksums and a manifest, at `output`. `tokenizer`:
    'bytes', or a tokenizer.json (or a folder with one), read with `storage_options` like the
    inputs; `output_options`: the output's storage options."""
    logger = get_run_logger()
    options = PrepareOptions(text_format, text_field)
    groups = plan_input_groups(inputs, tokenizer, storage_options, max(1, int(group_mb * 2**20)))
    futures = [prepare_shard.with_options(task_run_name=f"prepare-shard-{i}")
               .submit(urls, output, tokenizer, options, storage_options, output_options)
               for i, urls in enumerate(groups)]
    for future in as_completed(futures):  # said as each finishes; a failed one fails the run below
        future.wait()  # its final state held by the future (`state` alone may ask the API, which may lag)
        if future.state.is_completed():
            record, written = future.result()
            logger.info("shard %s: %d tokens from %d files (%s)", record.id, record.tokens, len(record.inputs),
                        "written" if written else "already there")
    prepared = [future.result() for future in futures]  # every group's shard, in input order
    shards = [record for record, _ in prepared]
    manifest = write_dataset_manifest(output, tokenizer, shards, options, storage_options, output_options)
    written = sum(1 for _, was_written in prepared if was_written)
    summary = {"shards": len(shards), "tokens": manifest.tokens, "documents": manifest.documents,
               "written": written, "reused": len(shards) - written,
               "manifest": ObjectStore(output, dict(output_options or {})).url_for(MANIFEST_KEY)}
    logger.info("prepared %s: %d tokens (%s), %d documents, %d shards (%d written, %d already there)", output,
                manifest.tokens, manifest.dtype, manifest.documents, len(shards), written, len(shards) - written)
    return summary
