"""The machine a benchmark runs on, as benchmarks read it."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator


def busy_cpu_s() -> float | None:
    """CPU seconds the whole machine has spent busy since boot (Linux /proc/stat), else None:
    every process's, those a benchmark does not start itself included (a detached forkserver
    and the workers it forks), so read it on an otherwise idle machine."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def busy_cores(count: int) -> Iterator[None]:
    """`count` processes spinning while the block runs: a loaded host, where processes are
    scheduled late and notice each other's deaths at different moments."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
