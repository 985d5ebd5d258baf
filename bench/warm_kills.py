"""How long a warm job's survivors take to leave after one rank is SIGKILLed, on a busy machine.

A 3-rank data-parallel job of a 1-layer GPT runs on one warm pool (`launcher.warm_pool`), round
after round; in each, rank 1 or 2 (alternately) is SIGKILLed once step 2 is reported, while
`--spinners` processes keep the cores busy (ranks then notice the death at different moments,
as on a loaded host). Per round: the seconds from the kill to the launch's return (a survivor
that does not leave by itself is ended after the launcher's grace, `PEER_GRACE_S`), the step the
survivors hold, and the survivors' thread counts a second after (a warm worker that kept its
job's process groups keeps their threads).

Last line JSON: rounds, `waited_grace` (rounds whose return took longer than the grace), the
median and largest kill-to-return seconds, `held_none` (rounds whose survivors held no step),
and the most threads a survivor had.

    OMP_NUM_THREADS=1 python -m bench.warm_kills [--rounds 50] [--spinners 2]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from parashift.bench.machine import busy_cores
from parashift.launcher.warm_launch import PEER_GRACE_S, launch_warm
from parashift.launcher.warm_pool import WarmPool
from parashift.specs import JobSpec
from parashift.specs.plan import Plan
from parashift.trainer.events import StartEvent, StepEvent


def job(name: str, store: str) -> JobSpec:
    return JobSpec.model_validate({
        "name": name,
        "model": {"n_layers": 1, "d_model": 32, "n_heads": 2, "vocab_size": 256, "seq_len": 32, "dropout": 0.0},
        "data": {"url": "builtin://python-stdlib", "max_bytes": 200_000},
        "training": {"global_batch": 8, "micro_batch": 2, "steps": 40, "checkpoint_every": 40, "stop_poll_s": 0},
        "resources": {"devices": 3, "kind": "cpu"},
        "storage": {"url": store},
    })


def threads_of(pid: int) -> int | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None  # gone: the launcher ended it
    return int(next(line for line in status.splitlines() if line.startswith("Threads:")).split()[1])


def one_round(pool: WarmPool, spec: JobSpec, victim: int) -> dict[str, Any]:
    pids: list[int] = []
    killed_at: list[float] = []

    def on_event(event: object) -> None:
        if isinstance(event, StartEvent):
            pids[:] = event.pids
        elif isinstance(event, StepEvent) and event.step >= 2 and not killed_at:
            killed_at.append(time.monotonic())
            os.kill(pids[victim], signal.SIGKILL)

    result = launch_warm(pool, spec, Plan.data_parallel(3), on_line=lambda line: None, on_event=on_event)
    returned_s = time.monotonic() - killed_at[0]
    time.sleep(1.0)  # the survivors clean up after answering
    threads = [threads_of(pid) for rank, pid in enumerate(pids) if rank != victim]
    return {"victim": victim, "kill_to_return_s": round(returned_s, 3), "held": result.held_step(),
            "survivor_threads": [t for t in threads if t is not None]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--spinners", type=int, default=2)
    args = parser.parse_args()
    pool = WarmPool(3)
    rounds = []
    try:
        with busy_cores(args.spinners), tempfile.TemporaryDirectory(prefix="warm-kills-") as folder:
            for i in range(args.rounds):
                rounds.append(one_round(pool, job(f"kills-{i}", f"file://{folder}/store"), victim=1 + i % 2))
                print(json.dumps(rounds[-1]), file=sys.stderr, flush=True)
    finally:
        pool.close()
    seconds = [r["kill_to_return_s"] for r in rounds]
    print(json.dumps({
        "bench": "warm_kills", "rounds": len(rounds), "spinners": args.spinners, "peer_grace_s": PEER_GRACE_S,
        "waited_grace": sum(s > PEER_GRACE_S for s in seconds),
        "kill_to_return_s_median": round(statistics.median(seconds), 3), "kill_to_return_s_max": max(seconds),
        "held_none": sum(r["held"] is None for r in rounds),
        "survivor_threads_max": max((t for r in rounds for t in r["survivor_threads"]), default=None),
    }))


if __name__ == "__main__":
    main()
