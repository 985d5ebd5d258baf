"""The held-out loss (training.eval_every): the same number under any plan or device count for
the same weights, across an elastic change, from held-out documents never trained on."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from jobs import mesh_plan, run, tiny_spec
from parashift.specs import JobSpec
from parashift.specs.plan import Plan
from parashift.trainer.data import builtin_corpus_files, load_tokens, split_held_out
from test_metrics_board import scalars

pytestmark = pytest.mark.slow

EVAL = {"training": {"steps": 8, "eval_every": 4, "eval_samples": 24, "checkpoint_every": 4},
        "data": {"eval_share": 0.2}, "model": {"n_layers": 2}}


def spec_in(tmp_path: Path, name: str) -> JobSpec:
    return tiny_spec(name, f"file://{tmp_path}/{name}", **EVAL)


def evals(*results: object) -> dict[int, float]:
    return {e.step: e.eval_loss for r in results for e in r.steps if e.eval_loss is not None}  # type: ignore[attr-defined]


def test_held_out_documents_are_whole_and_never_trained_on() -> None:
    spec = tiny_spec("split", "file:///unused", **EVAL).data
    train, held = split_held_out(spec, seed=7)
    again = split_held_out(spec, seed=7)
    assert (train == again[0]).all() and (held == again[1]).all()  # fixed by the seed
    corpus = load_tokens(spec)
    assert train.size + held.size == corpus.size and 0.2 * corpus.size <= held.size < 0.5 * corpus.size
    files = [np.frombuffer(Path(f.removeprefix("file://")).read_bytes(), dtype=np.uint8) for f in builtin_corpus_files()]
    first = bytes(held[:64].astype(np.uint8))  # the held-out tokens start where a file (a document) starts
    assert any(bytes(f[:64]) == first for f in files)
    assert not (np.isin(split_held_out(spec, seed=8)[1][:64], held[:64]).all() and
                split_held_out(spec, seed=8)[1].size == held.size), "another seed holds out other documents"


def test_eval_loss_is_the_same_under_every_plan_and_across_a_change(tmp_path: Path) -> None:
    static = run(spec_in(tmp_path, "static"), Plan.data_parallel(2))
    assert sorted(evals(static)) == [4, 8]
    board = scalars(tmp_path / "static/jobs/static/metrics")
    assert [step for step, _ in board["eval_loss"]] == [4, 8] and len(board["eval_perplexity"]) == 2
    # the same weights at step 4 under other plans (their steps differ only by rounding)
    for name, plan in (("one", Plan.data_parallel(1)), ("tp2", mesh_plan({"tp": 2})),
                       ("pp2", mesh_plan({"pp": 2}, micro_batches=2)), ("fsdp2", Plan.fully_sharded(2)),
                       ("dp3", Plan.data_parallel(3))):
        other = run(spec_in(tmp_path, name), plan, until_step=4)
        assert evals(other)[4] == pytest.approx(evals(static)[4], rel=1e-6), name
    # 2 -> 3 devices at step 4: the held-out loss after the change is the static run's
    elastic = spec_in(tmp_path, "elastic")
    first = run(elastic, Plan.data_parallel(2), until_step=4)
    second = run(elastic, Plan.data_parallel(3))
    assert evals(first)[4] == evals(static)[4]  # the same plan: the same bits
    assert evals(second)[8] == pytest.approx(evals(static)[8], rel=1e-6)
    assert evals(static)[8] < evals(static)[4]  # it learns
