"""A pool over nodes (`pool.placement`): over random sequences of allocations, every job runs on
whole nodes, no node serves two jobs, a job that keeps its count keeps its nodes, one that
shrinks keeps the first of them, and growth takes free nodes in the pool's order."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from parashift.pool.placement import place, pool_counts, whole_nodes


@st.composite
def allocations(draw: st.DrawFn) -> tuple[list[str], int, list[dict[str, int]]]:
    """A pool's nodes, their size, and a sequence of allocations of whole nodes to jobs."""
    nodes = [f"n{i}" for i in range(draw(st.integers(1, 8)))]
    per_node = draw(st.integers(1, 4))
    jobs = [f"job{i}" for i in range(draw(st.integers(1, 6)))]
    rounds = []
    for _ in range(draw(st.integers(1, 6))):
        left, counts = len(nodes), {}
        for job in draw(st.permutations(jobs)):
            k = draw(st.integers(0, left))
            counts[job], left = k * per_node, left - k
        rounds.append(counts)
    return nodes, per_node, rounds


@settings(max_examples=300, deadline=None)
@given(allocations())
def test_whole_nodes_to_one_job_each_moving_as_little_as_possible(case: tuple[list[str], int, list[dict[str, int]]]) -> None:
    nodes, per_node, rounds = case
    running: dict[str, list[str]] = {}
    for counts in rounds:
        placed = place(counts, running, nodes, per_node)
        assert {job for job, n in counts.items() if n} == set(placed)
        held = [node for job_nodes in placed.values() for node in job_nodes]
        assert len(held) == len(set(held)) and set(held) <= set(nodes), "no node serves two jobs"
        kept_all, grown_all = set(), set()
        for job, job_nodes in placed.items():
            assert len(job_nodes) * per_node == counts[job], "whole nodes, as many as its count needs"
            before = running.get(job, [])
            kept = job_nodes[: min(len(before), len(job_nodes))]
            assert kept == before[: len(kept)], "it keeps the first of the nodes it had"
            kept_all.update(kept)
            grown_all.update(job_nodes[len(kept):])
        free = [node for node in nodes if node not in kept_all]
        assert grown_all == set(free[: len(grown_all)]), "growth takes free nodes in the pool's order"
        running = placed


def test_a_count_of_part_of_a_node_or_more_nodes_than_the_pool_is_refused() -> None:
    with pytest.raises(ValueError, match="whole number of 4-device nodes"):
        place({"a": 6}, {}, ["x", "y"], 4)
    with pytest.raises(ValueError, match="3 nodes given out, the pool has 2"):
        place({"a": 4, "b": 8}, {}, ["x", "y"], 4)


def test_counts_requests_and_minimums_become_whole_nodes() -> None:
    assert pool_counts([1, 2, 3, 4, 5, 6, 7, 8], 4) == [4, 8]
    assert [whole_nodes(n, 4) for n in (1, 4, 5, 8)] == [1, 1, 2, 2]
