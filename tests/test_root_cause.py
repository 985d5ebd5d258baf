"""The reason a segment failed names the rank that died, not the peers whose collectives broke
after it: one rank of a 3-rank job SIGKILLed mid-training, on warm workers and through
torchrun, the victim chosen by round, while the machine is busy training."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from jobs import tiny_spec
from parashift.launcher.launch import launch_workers
from parashift.launcher.segment import failure_reason
from parashift.launcher.warm_launch import launch_warm
from parashift.launcher.warm_pool import WarmPool
from parashift.specs.plan import Plan
from parashift.trainer.events import StartEvent, StepEvent

pytestmark = pytest.mark.slow

# Kills per path in the suite; bench runs of 20 each are in BENCHMARKS.md ("Root cause").
ROUNDS = {"warm": int(os.environ.get("PARASHIFT_ROOT_CAUSE_ROUNDS", "6")),
          "torchrun": int(os.environ.get("PARASHIFT_ROOT_CAUSE_ROUNDS", "2"))}


def kill_at_step_two(victim: int, killed: list[int]):
    """An on_event that SIGKILLs rank `victim` once step 2 is reported (its pid from the start event)."""
    pids: list[int] = []

    def on_event(event: object) -> None:
        if isinstance(event, StartEvent):
            pids[:] = event.pids
        elif isinstance(event, StepEvent) and event.step >= 2 and not killed:
            killed.append(pids[victim])
            os.kill(pids[victim], signal.SIGKILL)

    return on_event


@pytest.fixture
def busy_machine() -> Iterator[None]:
    """A process spinning on each core while the test runs: ranks then notice a peer's death
    at different moments, as on a loaded host."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


@pytest.mark.parametrize("path", ["warm", "torchrun"])
def test_the_reason_names_the_killed_rank(path: str, tmp_path: Path, busy_machine: None) -> None:
    pool = WarmPool(3) if path == "warm" else None
    try:
        for i in range(ROUNDS[path]):
            victim = 1 + i % 2  # ranks 1 and 2: rank 0 reports the events
            spec = tiny_spec(f"root-{path}-{i}", f"file://{tmp_path}/store",
                             training={"steps": 40, "checkpoint_every": 40, "log_every": 1})
            killed: list[int] = []
            lines: list[str] = []
            on_event = kill_at_step_two(victim, killed)
            if pool is not None:
                result = launch_warm(pool, spec, Plan.data_parallel(3), on_line=lines.append, on_event=on_event)
            else:
                result = launch_workers(spec, Plan.data_parallel(3), on_line=lines.append, on_event=on_event)
            assert killed and result.returncode != 0
            reason = failure_reason(result, lines)
            assert reason.startswith(f"rank {victim} killed by signal 9"), (i, reason)
    finally:
        if pool is not None:
            pool.close()
