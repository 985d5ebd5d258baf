"""torchrun's agent as parashift runs it (launcher.agent): its rendezvous events are named as
torch names them, without reading a source file."""

from __future__ import annotations

import inspect

import pytest
from parashift.launcher import agent
from torch.distributed.elastic.rendezvous import dynamic_rendezvous

TORCHS = dynamic_rendezvous.get_method_name  # torch's own, before any patch in this process


def _record(name_of) -> str:  # as torch's `_record`: asks for the name of the method that called it
    return name_of()


def next_rendezvous(name_of) -> str:
    return _record(name_of)


def test_event_names_are_torchs_and_read_no_source(monkeypatch: pytest.MonkeyPatch) -> None:
    assert next_rendezvous(agent.method_name) == next_rendezvous(TORCHS) == "next_rendezvous"
    for depth in (1, 3, 10_000):  # (0 is the asking function itself)
        assert agent.method_name(depth) == TORCHS(depth), depth

    def no_stack(*args, **kwargs):
        raise AssertionError("inspect.stack() called")

    monkeypatch.setattr(dynamic_rendezvous, "get_method_name", TORCHS)
    agent.name_events_cheaply()
    monkeypatch.setattr(inspect, "stack", no_stack)
    assert next_rendezvous(dynamic_rendezvous.get_method_name) == "next_rendezvous"


def test_a_one_node_rendezvous_joins_without_its_random_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    waits: list[float | tuple[float, float]] = []
    monkeypatch.setattr(dynamic_rendezvous, "_delay", waits.append)
    agent.join_without_jitter()
    dynamic_rendezvous._delay(seconds=(0, 0.3))  # the first join's spread: gone
    dynamic_rendezvous._delay(seconds=1)  # a poll's wait: kept
    assert waits == [1]
