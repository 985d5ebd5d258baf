"""The data pipeline: deterministic order, exact coverage, shares that add up on any device count."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from parashift.specs import DataSpec
from parashift.trainer.data import SampleStream, load_tokens, micro_batches, rank_share


@given(global_batch=st.integers(1, 64), world=st.integers(1, 8))
def test_rank_shares_partition_the_global_batch(global_batch: int, world: int) -> None:
    if world > global_batch:
        return
    covered: list[int] = []
    for rank in range(world):
        offset, count = rank_share(global_batch, world, rank)
        covered.extend(range(offset, offset + count))
        assert sum(size for _, size in micro_batches(count, 3)) == count
    assert covered == list(range(global_batch))


def test_every_sample_of_an_epoch_is_seen_exactly_once() -> None:
    stream = SampleStream(np.arange(1000, dtype=np.uint16), seq_len=10, seed=3)
    n = stream.samples_per_epoch
    ids = stream.sample_ids(0, n)
    assert sorted(i for _, i in ids) == list(range(n)) and {e for e, _ in ids} == {0}
    # the next epoch is a different order of the same samples
    nxt = stream.sample_ids(n, n)
    assert sorted(i for _, i in nxt) == list(range(n)) and [i for _, i in nxt] != [i for _, i in ids]


def test_order_depends_on_seed_only() -> None:
    a = SampleStream(np.arange(500, dtype=np.uint16), 8, seed=1).sample_ids(0, 40)
    b = SampleStream(np.arange(500, dtype=np.uint16), 8, seed=1).sample_ids(0, 40)
    c = SampleStream(np.arange(500, dtype=np.uint16), 8, seed=2).sample_ids(0, 40)
    assert a == b and a != c


def test_targets_are_inputs_shifted_by_one() -> None:
    stream = SampleStream(np.arange(200, dtype=np.uint16), 8, seed=0)
    inputs, targets = stream.batch(5, 3)
    assert inputs.shape == (3, 8) and targets.shape == (3, 8)
    assert (targets[:, :-1] == inputs[:, 1:]).all()


def test_builtin_corpus_loads_bytes(tmp_path) -> None:
    tokens = load_tokens(DataSpec(url="builtin://python-stdlib", max_bytes=10_000))
    assert len(tokens) == 10_000 and tokens.max() < 256


def test_text_glob_and_token_files(tmp_path) -> None:
    (tmp_path / "a.txt").write_bytes(b"hello ")
    (tmp_path / "b.txt").write_bytes(b"world")
    tokens = load_tokens(DataSpec(url=f"file://{tmp_path}/*.txt"))
    assert bytes(tokens.astype(np.uint8)) == b"hello world"
    # `max_bytes: null` is "all of it" (it asked each file for 2**62 bytes: a MemoryError, retried as a failure)
    assert bytes(load_tokens(DataSpec(url=f"file://{tmp_path}/*.txt", max_bytes=None)).astype(np.uint8)) == b"hello world"
    np.array([1, 300, 65535], dtype="<u2").tofile(tmp_path / "t.bin")
    toks = load_tokens(DataSpec(url=f"file://{tmp_path}/t.bin", format="tokens"))
    assert toks.tolist() == [1, 300, 65535]


def test_the_prefetcher_reads_each_step_in_order_and_ends_at_close_with_its_queue_full() -> None:
    """Batches arrive step by step from the position given; close ends the thread even while it
    waits on a full queue (what it read ahead is dropped, nothing else)."""
    import time

    from parashift.trainer.data import Prefetcher

    stream = SampleStream(np.arange(1000, dtype=np.uint16), seq_len=10, seed=3)
    prefetcher = Prefetcher(stream, share_offset=2, requests=[(0, 2), (2, 1)], global_batch=6, depth=2)
    prefetcher.start(12)
    for position in (12, 18):
        got = prefetcher.step(position)
        want = [stream.batch(position + 2, 2), stream.batch(position + 4, 1)]
        assert all(np.array_equal(g[0], w[0]) and np.array_equal(g[1], w[1]) for g, w in zip(got, want, strict=True))
    deadline = time.monotonic() + 10
    while not prefetcher._queue.full() and time.monotonic() < deadline:  # the thread is ahead, waiting to put
        time.sleep(0.01)
    prefetcher.close()
    assert prefetcher._thread is not None and not prefetcher._thread.is_alive()
