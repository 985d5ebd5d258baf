"""The planner's reference search, timed, with a digest of what it returns: the cases of
tests/test_planner_outer.py (GPT graphs at 4, 8 and 16 devices, with and without memory limits
that force tensor or pipeline parallelism and the Lagrangian branch and bound), each planned
with pruning off (the plain search: every candidate evaluated) and on.

A change to the search's speed must leave `digest` as it was: it hashes every plan returned
(`Plan.model_dump()`), so the same digest is the same plans, bit for bit. `seconds` is the
whole run, `--rounds` times (median). Run from the repository's root (the cases are imported
from the test, so the two stay one list). Last line: one JSON object.

    .venv/bin/python -m bench.plan_reference [--rounds 1]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import time
from typing import Any


def run_cases() -> tuple[float, list[str]]:
    """Seconds for every case, plain then pruned, and a hash of each plan."""
    from parashift.planner import search
    from parashift.planner.profile import profile_graph
    from parashift.planner.search import plan_model

    from tests.test_planner_outer import CASES, GRAPHS

    hashes, start = [], time.perf_counter()
    for graph, p, fraction, max_pp in CASES:
        prof = profile_graph(GRAPHS[graph](), "cuda", devices_per_node=4)
        limit = None
        if fraction is not None:
            search.PRUNE = False
            limit = int(plan_model(prof, p, None, max_pp=1, max_tp=1).memory_per_device_bytes * fraction)
        for prune in (False, True):
            search.PRUNE = prune
            plan = plan_model(prof, p, limit, max_pp=max_pp)
            hashes.append(hashlib.sha1(json.dumps(plan.model_dump(), sort_keys=True, default=str).encode()).hexdigest())
    search.PRUNE = True
    return time.perf_counter() - start, hashes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    rounds: list[float] = []
    digests: set[str] = set()
    for _ in range(args.rounds):
        seconds, hashes = run_cases()
        rounds.append(round(seconds, 2))
        digests.add(hashlib.sha1("".join(hashes).encode()).hexdigest())
    out: dict[str, Any] = {"bench": "plan_reference", "machine": f"{platform.machine()} {os.cpu_count()} cores",
                           "plans": len(hashes), "seconds": statistics.median(rounds), "rounds": rounds,
                           "digest": digests.pop() if len(digests) == 1 else sorted(digests)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
