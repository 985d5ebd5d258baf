"""The prepare-data flow against a real Prefect server: the same dataset as corpus.prepare's
plain function, and idempotent (a rerun keeps every shard, a lost shard alone is redone)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.slow


def write_corpus(folder: Path) -> None:
    folder.mkdir()
    for i in range(6):
        lines = [f"file {i}, line {n}: the quick brown fox jumps over the lazy dog. déjà vu №{n * i}" for n in range(20)]
        (folder / f"doc{i}.txt").write_text("\n".join(lines), encoding="utf-8")
    records = [{"text": f"record {n}: some JSONL text, ünïcödé included", "id": n} for n in range(30)]
    (folder / "records.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n", encoding="utf-8")


def run_log(state: Any, last: str, timeout_s: float = 30) -> list[str]:
    """The messages of the flow run's log, once one starts with `last` (Prefect ships logs to
    the server in the background, in order)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    where = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[state.state_details.flow_run_id]))
    deadline = time.monotonic() + timeout_s
    while True:
        with get_client(sync_client=True) as client:
            messages = [log.message for log in client.read_logs(where, limit=200)]
        if any(m.startswith(last) for m in messages) or time.monotonic() > deadline:
            return messages
        time.sleep(0.1)


def test_prepare_data_flow_matches_the_plain_function_and_resumes(prefect_server: None, tmp_path: Path) -> None:
    from parashift.corpus import BYTES_TOKENIZER, PrepareOptions, open_dataset, prepare_dataset
    from parashift.flows.prepare_data import prepare_data

    write_corpus(tmp_path / "in")
    inputs, output = f"file://{tmp_path}/in/*", f"file://{tmp_path}/flow"
    group_mb = 4 / 1024  # 4 KiB of input per shard: 2 text files a group, the JSONL alone

    summary = prepare_data(inputs, output, group_mb=group_mb)
    assert summary["shards"] >= 3 and summary["written"] == summary["shards"] and summary["reused"] == 0
    assert summary["manifest"] == f"file://{tmp_path}/flow/dataset.json"
    dataset = open_dataset(output)
    assert len(dataset) == summary["tokens"] and dataset.manifest.documents == summary["documents"] == 6 + 30

    plain = prepare_dataset(inputs, f"file://{tmp_path}/plain", BYTES_TOKENIZER, PrepareOptions(),
                            group_bytes=int(group_mb * 2**20))
    reference = open_dataset(f"file://{tmp_path}/plain")
    assert [s.id for s in dataset.manifest.shards] == [s.id for s in plain.shards]  # same groups, same order
    [tokens], [expected] = dataset.read_many([(0, len(dataset))]), reference.read_many([(0, len(reference))])
    np.testing.assert_array_equal(tokens, expected)

    state = prepare_data(inputs, output, group_mb=group_mb, return_state=True)
    again = state.result()
    assert again["written"] == 0 and again["reused"] == summary["shards"] and again["tokens"] == summary["tokens"]
    said = sorted(m for m in run_log(state, "prepared ") if m.startswith("shard "))
    assert said == sorted(f"shard {s.id}: {s.tokens} tokens from {len(s.inputs)} files (already there)"
                          for s in dataset.manifest.shards)

    lost = dataset.manifest.shards[1]
    (tmp_path / "flow" / lost.record_key).unlink()  # a run that died before this shard's commit
    resumed = prepare_data(inputs, output, group_mb=group_mb)
    assert resumed["written"] == 1 and resumed["reused"] == summary["shards"] - 1
    np.testing.assert_array_equal(open_dataset(output).read_many([(0, len(dataset))])[0], expected)
