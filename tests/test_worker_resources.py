"""What a worker process keeps: the memory a step frees (`trainer.launch.worker_env`), which the
next step's tensors reuse instead of faulting fresh pages in from the kernel; and, in a warm
worker, nothing of a job that has ended (`trainer.mesh.forget_meshes`)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from jobs import mesh_plan, run, store_url, tiny_spec, warm_pool
from parashift.trainer.launch import worker_env

# A step's worth of tensors of mixed sizes (MiB), allocated, written and freed three times: the
# fraction of their pages each pass faulted in.
STEPS = """
import json, resource, torch
def faults(): return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
sizes = [8, 3, 24, 1, 40, 8, 8, 2] * 3
passes = []
for _ in range(3):
    before = faults()
    tensors = [torch.ones(mb * 262144) for mb in sizes]
    del tensors
    passes.append((faults() - before) / (sum(sizes) * 256))
print(json.dumps(passes))
"""


def faulted_fractions(env: dict[str, str]) -> list[float]:
    out = subprocess.run([sys.executable, "-c", STEPS], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_a_worker_reuses_the_memory_a_step_freed() -> None:
    first, _, third = faulted_fractions(worker_env("cpu"))
    assert first > 0.9  # fresh memory: every page faulted in once
    assert third < 0.1, third  # the same tensors again: the freed memory is reused
    # Without it (glibc's defaults), freed blocks go back to the kernel and are faulted in again.
    assert faulted_fractions({**worker_env("cpu"), "GLIBC_TUNABLES": ""})[2] > 0.2


def test_the_users_own_tunables_win(monkeypatch) -> None:  # noqa: ANN001 - pytest's fixture
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")
    assert worker_env("cpu")["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2"


def settled_threads(pid: int, timeout_s: float = 30.0) -> int:
    """The worker's thread count once it has finished cleaning up after its job (which it does
    after answering): unchanged for a second."""
    def count() -> int:
        status = Path(f"/proc/{pid}/status").read_text()
        return int(next(line for line in status.splitlines() if line.startswith("Threads:")).split()[1])

    deadline, last = time.monotonic() + timeout_s, count()
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = count()
        if now == last:
            return now
        last = now
    return last


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="thread counts from Linux /proc")
def test_a_warm_worker_keeps_no_process_group_of_a_job_that_ended(tmp_path: Path) -> None:
    """Each mesh shape is new to the workers: before, DTensor's caches kept every mesh, each
    with its gloo groups' threads (14, 30, 46 threads after three such jobs)."""
    counts = []
    for i, mesh in enumerate(({"dp": 2}, {"tp": 2}, {"dp": 2, "tp": 2})):
        spec = tiny_spec(f"threads-{i}", store_url(tmp_path), model={"n_layers": 2, "n_heads": 4}, training={"steps": 2})
        run(spec, mesh_plan(mesh))
        counts.append([settled_threads(pid) for pid in warm_pool().pids(2)])
    assert counts[2] <= counts[0], counts
