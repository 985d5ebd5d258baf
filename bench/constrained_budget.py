"""The memory-constrained stage search on a small stage it cannot prove within its budget
(`planner.builders.gapped_chain` at 8 devices): the branch and bound alone, the branch and bound
then enumeration (what the planner runs), and enumeration alone. Prints one JSON object.

    python -m bench.constrained_budget [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

from parashift.planner import dp, stage
from parashift.planner.builders import gapped_chain
from parashift.planner.comm import default_comm
from parashift.planner.configs import counts_mesh
from parashift.planner.costs import CostModel
from parashift.planner.problem import Weights, build_problem
from parashift.planner.profile import DEFAULT_DEVICES
from parashift.planner.stage import StageSolver


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    rounds = parser.parse_args().rounds
    graph, w = gapped_chain(), Weights(weight=2.0, inflight=2.0)
    costs = CostModel(graph, DEFAULT_DEVICES["cuda"], default_comm("cuda", devices_per_node=4), counts_mesh(8, devices_per_node=4))
    problem, memory = build_problem(graph, costs, 0.0, w), build_problem(graph, costs, w=w, memory_only=True)
    limit = (dp.solve(memory)[1] + StageSolver(graph, costs, None, w).first().memory_bytes) / 2
    cases = []
    for name, work in (("search alone", 0.0), ("search, then enumeration", stage.ENUMERATE_WORK)):
        stage.ENUMERATE_WORK, times = work, []
        for _ in range(rounds):
            started = time.perf_counter()
            res, met = StageSolver(graph, costs, limit, w).finish()
            times.append(time.perf_counter() - started)
        cases.append({"case": name, "median_s": statistics.median(times), "time_s": res.time_s, "bound_s": res.bound,
                      "proven": res.proven, "solutions_met": len(met)})
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        found = dp.brute_force_constrained(problem, memory, limit)
        times.append(time.perf_counter() - started)
    assert found is not None
    cases.append({"case": "enumeration alone", "median_s": statistics.median(times), "time_s": found[1]})
    print(json.dumps({"assignments": math.prod(problem.card), "limit_bytes": limit, "cases": cases}))


if __name__ == "__main__":
    main()
