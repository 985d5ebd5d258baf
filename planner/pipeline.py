"""Pipeline stages: contiguous runs of blocks (layers), micro-batches, the per-op DP inside each.

After Alpa's inter-op pass (Zheng et al. 2022, section 5) in a simple form: the graph's blocks
are cut into `pp` contiguous stages (balanced, or one block lighter at either end where the
embedding and head sit), the step runs `m` micro-batches with a 1F1B schedule, so a stage's
step time is (m + pp - 1) x its per-micro-batch time plus its gradient sync, and it holds
min(m, pp) micro-batches of activations. Stage-boundary activations go point to point (the
comm model's p2p link where measured). The step takes as long as the slowest stage (the bubble
is in the m + pp - 1 factor). planner/outer.py enumerates pipelined candidates with these pieces.

CPU workers outnumbering cores (`DeviceModel.core_share` < 1): the per-op costs are at the
shared rate every worker gets while all are busy, but a stage waiting in the bubble frees its
core for the others. The step is then bounded by the critical path at the rate of a whole core
(share x compute + communication on the slowest stage, plus the boundary) and by the busy work
of all workers over the cores (m micro-batches of the stages' mean compute at the shared rate,
plus the slowest stage's communication), and takes the larger (`step_time`). With a core per
worker (GPUs, or CPU workers <= cores) this is the slowest stage, as before.
"""

from __future__ import annotations

from parashift.planner.comm import CommModel
from parashift.planner.graph import Graph


def block_order(graph: Graph) -> list[str]:
    """Block instances in topological order of their first op."""
    seen: list[str] = []
    for op in graph.ops:
        if op.block is not None and op.block not in seen:
            seen.append(op.block)
    return seen


def stage_splits(n_blocks: int, pp: int) -> list[list[int]]:
    """Block counts per stage: balanced, and one with both end stages a block lighter."""
    base, extra = divmod(n_blocks, pp)
    balanced = [base + (1 if i < extra else 0) for i in range(pp)]
    out = [balanced]
    if pp >= 3 and base >= 2:
        for ends in ((1, 1),):
            counts = [base] * pp
            counts[0] -= ends[0]
            counts[-1] -= ends[1]
            spare = n_blocks - sum(counts)
            for i in range(1, pp - 1):
                if spare <= 0:
                    break
                add = -(-spare // (pp - 1 - i)) if i < pp - 1 else spare
                counts[i] += add
                spare -= add
            if spare == 0 and counts not in out:
                out.append(counts)
    return [c for c in out if all(n >= 1 for n in c)]


def stage_ops(graph: Graph, blocks: list[str], counts: list[int]) -> list[list[str]]:
    """Op names per stage: ops before the first block join stage 0, after the last the last."""
    stage_of_block, b = {}, 0
    for s, n in enumerate(counts):
        for _ in range(n):
            stage_of_block[blocks[b]] = s
            b += 1
    stages: list[list[str]] = [[] for _ in counts]
    current = 0
    for op in graph.ops:
        if op.block is not None:
            current = stage_of_block[op.block]
        stages[current].append(op.name)
    return stages


def boundary_s(comm: CommModel, worst_bytes: float, pp: int, dp: int, tp: int, micro_batches: int) -> float:
    """Seconds per step of sends across stage boundaries: in each of the m + pp - 1 micro-batch
    slots the largest crossing activation forward and its gradient back, point to point (the
    comm model's p2p link where measured), each of the `dp` replicas sending its share and
    paying the latency. The pp axis is outermost, so neighbours are dp x tp ranks apart."""
    if not worst_bytes:
        return 0.0
    intra = dp * tp * 2 <= comm.devices_per_node
    return comm.transfer(worst_bytes / dp, intra) * 2.0 * (micro_batches + pp - 1)


def step_time(stages: list, micro_batches: int, boundary: float, core_share: float = 1.0) -> float:
    """Seconds per step of a pipeline whose stages (planner.search.StageResult, each with its
    per-op compute and communication over `weight` = m + pp - 1 evaluations) send for
    `boundary` seconds across stage boundaries per step (`boundary_s`).

    `core_share` 1 (a core or a GPU per worker): the slowest stage plus the boundary. Below 1
    (CPU workers outnumbering cores, compute at the shared rate): the larger of the critical
    path at a whole core's rate and the busy work of every worker over the cores.
    """
    slowest = max(st.time_s for st in stages) + boundary
    if core_share >= 1.0:
        return slowest
    compute = [sum(r.compute_s for r in st.rows) for st in stages]
    comm = [sum(r.comm_s for r in st.rows) for st in stages]
    critical = max(core_share * c + k for c, k in zip(compute, comm, strict=True)) + boundary
    # Each stage has the same number of workers, each busy for m of its `weight` evaluations:
    # all workers' work over the cores = m x the stages' mean compute at the shared rate.
    per_eval = [c / st.weights.weight for c, st in zip(compute, stages, strict=True)]
    work = micro_batches * sum(per_eval) / len(stages) + max(comm)
    return min(slowest, max(critical, work))
