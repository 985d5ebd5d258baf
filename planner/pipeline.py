"""Pipeline stages: contiguous runs of blocks (layers), micro-batches, the per-op DP inside each.

After Alpa's inter-op pass (Zheng et al. 2022, section 5) in a simple form: the graph's blocks
are cut into `pp` contiguous stages (balanced, or one block lighter at either end where the
embedding and head sit), the step runs `m` micro-batches with a 1F1B schedule, so a stage's
step time is (m + pp - 1) x its per-micro-batch time plus its gradient sync, and it holds
min(m, pp) micro-batches of activations. Stage-boundary activations go point to point (the
comm model's p2p link where measured). The step takes as long as the slowest stage (the bubble
is in the m + pp - 1 factor).

CPU workers outnumbering cores (`DeviceModel.core_share` < 1): the per-op costs are at the
shared rate every worker gets while all are busy, but a stage waiting in the bubble frees its
core for the others. The step is then bounded by the critical path at the rate of a whole core
(share x compute + communication on the slowest stage, plus the boundary) and by the busy work
of all workers over the cores (m micro-batches of the stages' mean compute at the shared rate,
plus the slowest stage's communication), and takes the larger (`step_time`). With a core per
worker (GPUs, or CPU workers <= cores) this is the slowest stage, as before.
Stages with the same ops and edges (up to names) are solved once.
"""

from __future__ import annotations

from planner.configs import named_mesh
from planner.costs import CostModel
from planner.graph import Graph
from planner.problem import Weights
from planner.profile import ModelProfile
from planner.stage import Candidate, StageResult, micro_batch_options, solve_stage, weights_floor


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


def _stage_ops(graph: Graph, blocks: list[str], counts: list[int]) -> list[list[str]]:
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


def _key(sub: Graph, costs: CostModel) -> tuple:
    index = sub.index()
    return (tuple(costs.signature(op.name) for op in sub.ops),
            tuple((index[e.src], index[e.dst], e.slot) for e in sub.edges))


def pipelined(profile: ModelProfile, pp: int, dp: int, tp: int, limit: float | None, method: str,
              skip_unfit: bool = True) -> list:
    """Candidates (planner.stage.Candidate) per micro-batch count and stage split; pp may be 1
    (gradient accumulation). `skip_unfit` False: also meshes whose weights cannot fit (to find
    the layout closest to fitting when nothing does)."""
    g = profile.graph
    blocks = block_order(g)
    if len(blocks) < pp or g.batch_dim not in g.ops[0].dims:
        return []
    # Weights are split at most tp x pp ways ("dp" only splits the batch): a lower bound.
    if skip_unfit and limit is not None and weights_floor(profile, pp, dp, tp) > limit:
        return []
    batch = g.ops[0].dims[g.batch_dim]
    mesh = named_mesh(dp, tp, profile.comm.devices_per_node, g.batch_dim, profile.shard_dp)
    # Stage boundaries: the pp axis is outermost, so neighbours are dp x tp ranks apart.
    intra = dp * tp * 2 <= profile.comm.devices_per_node
    out = []
    for m in micro_batch_options(batch, pp, dp):
        gm = g.with_batch(batch // m)
        costs = CostModel(gm, profile.device, profile.comm, mesh)
        w = Weights(weight=float(m + pp - 1), inflight=float(min(m, pp)))
        solved: dict[tuple, object] = {}
        for counts in stage_splits(len(blocks), pp):
            names = _stage_ops(gm, blocks, counts)
            results = []
            for stage in names:
                sub = gm.subgraph(stage)
                key = _key(sub, costs)
                if key not in solved:
                    solved[key] = solve_stage(sub, costs, limit, w, method)[0]
                r = solved[key]
                results.append(StageResult(sub, costs, r.assign, w, r.rows, r.lam))
            # Each dp replica sends its batch share; forward activations and backward gradients.
            boundary = _boundary_s(gm, names, profile, intra, dp) * 2.0 * (m + pp - 1)
            time_s = step_time(results, m, boundary, profile.device.core_share)
            memory = max(r.memory_bytes for r in results)
            if pp == 1 and m == 1:
                continue  # the unpipelined search covers it
            out.append(Candidate("pase-dp+pipeline" if method == "dp" else "exhaustive+pipeline", pp, dp, tp, m,
                                 results, time_s, memory, [f"stages of {counts} blocks, {m} micro-batches (1F1B)"]))
    return out


def _boundary_s(graph: Graph, stages: list[list[str]], profile: ModelProfile, intra: bool, dp: int = 1) -> float:
    """Seconds per micro-batch to send the largest stage-boundary activation to the next stage:
    each of `dp` replicas sends its share of the bytes, and each send pays the latency."""
    where = {name: s for s, names in enumerate(stages) for name in names}
    ops = {op.name: op for op in graph.ops}
    worst = 0.0
    for e in graph.edges:
        if where[e.src] != where[e.dst]:
            src = ops[e.src]
            worst = max(worst, float(src.numel(src.output) * graph.act_bytes))
    return profile.comm.transfer(worst / dp, intra) if worst else 0.0


def step_time(stages: list, micro_batches: int, boundary_s: float, core_share: float = 1.0) -> float:
    """Seconds per step of a pipeline whose stages (planner.search.StageResult, each with its
    per-op compute and communication over `weight` = m + pp - 1 evaluations) send
    `boundary_s` across stage boundaries per step.

    `core_share` 1 (a core or a GPU per worker): the slowest stage plus the boundary. Below 1
    (CPU workers outnumbering cores, compute at the shared rate): the larger of the critical
    path at a whole core's rate and the busy work of every worker over the cores.
    """
    slowest = max(st.time_s for st in stages) + boundary_s  # as planner.outer sums it
    if core_share >= 1.0:
        return slowest
    compute = [sum(r.compute_s for r in st.rows) for st in stages]
    comm = [sum(r.comm_s for r in st.rows) for st in stages]
    critical = max(core_share * c + k for c, k in zip(compute, comm, strict=True)) + boundary_s
    # Each stage has the same number of workers, each busy for m of its `weight` evaluations:
    # all workers' work over the cores = m x the stages' mean compute at the shared rate.
    per_eval = [c / st.weights.weight for c, st in zip(compute, stages, strict=True)]
    work = micro_batches * sum(per_eval) / len(stages) + max(comm)
    return min(slowest, max(critical, work))
