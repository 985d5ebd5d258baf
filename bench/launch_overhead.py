"""What one torchrun launch of a tiny job costs: its wall time (`launch_workers`' call) and the
machine's CPU over it (every process: the agent, the workers, their forkserver clients), over
several rounds (medians), on a forkserver already serving (the first launch starts it and is
left out).

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.launch_overhead [--rounds 9] [--steps 12]

Run on an otherwise idle machine: the CPU is read from /proc/stat. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

from parashift.bench.machine import busy_cpu_s
from parashift.launcher.forkservers import stop_all
from parashift.launcher.launch import launch_workers
from parashift.specs import JobSpec
from parashift.specs.environ import FORKSERVER_DIR
from parashift.specs.plan import Plan


def machine_cpu_s() -> float:
    busy = busy_cpu_s()
    if busy is None:
        raise SystemExit("this benchmark reads the machine's CPU from /proc/stat (Linux)")
    return busy


def tiny_job(name: str, store: Path, steps: int) -> JobSpec:
    return JobSpec.model_validate({
        "name": name,
        "model": {"n_layers": 1, "d_model": 32, "n_heads": 2, "vocab_size": 256, "seq_len": 32},
        "data": {"url": "builtin://python-stdlib", "max_bytes": 200_000},
        "training": {"global_batch": 8, "micro_batch": 2, "steps": steps, "checkpoint_every": steps},
        "resources": {"devices": 2, "kind": "cpu"},
        "storage": {"url": f"file://{store}"},
    })


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    walls, cpus = [], []
    with tempfile.TemporaryDirectory(prefix="parashift-launch-bench-") as tmp:
        servers = Path(tmp, "fs")
        servers.mkdir(mode=0o700)
        os.environ[FORKSERVER_DIR] = str(servers)  # a forkserver of this bench's own
        try:
            for i in range(args.rounds + 1):
                spec = tiny_job(f"launch-{i}", Path(tmp, f"store{i}"), args.steps)
                cpu, start = machine_cpu_s(), time.monotonic()
                result = launch_workers(spec, Plan.data_parallel(2))
                wall, cpu = time.monotonic() - start, machine_cpu_s() - cpu
                if result.returncode != 0 or len(result.steps) != args.steps:
                    raise SystemExit(f"round {i}: exit code {result.returncode}, {len(result.steps)} steps")
                if i:  # the first started the forkserver
                    walls.append(wall)
                    cpus.append(cpu)
        finally:
            stop_all(servers)
    print(json.dumps({
        "bench": "launch_overhead", "machine": f"{platform.machine()} {os.cpu_count()} cores",
        "steps": args.steps, "rounds": args.rounds,
        "wall_s": round(statistics.median(walls), 3), "cpu_s": round(statistics.median(cpus), 3),
        "wall_s_rounds": [round(w, 3) for w in walls], "cpu_s_rounds": [round(c, 2) for c in cpus],
    }))


if __name__ == "__main__":
    main()
