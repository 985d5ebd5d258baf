"""The two strategies every plan is compared with, as assignments in the searched space.

- data parallel: the batch split over all devices, every weight replicated;
- Megatron-LM's heuristic (Narayanan et al. 2021, section 3.3): tensor parallelism inside a node
  up to 8 ways on each op's Megatron dim (heads, ffn, vocab), data parallelism across.

Both are points of the DP's space on their mesh, so the DP's optimum can never cost more.
"""

from __future__ import annotations

from parashift.planner.configs import Mesh, named_mesh
from parashift.planner.costs import CostModel
from parashift.planner.graph import Graph


def baseline_assign(graph: Graph, costs: CostModel) -> list[int] | None:
    """Batch on "dp", each op's `tp_dim` on "tp" (else replicated); None when a split is uneven."""
    mesh = costs.mesh
    assign = []
    for op in graph.ops:
        want = []
        for name in mesh.names:
            dim = graph.batch_dim if name == "dp" else op.tp_dim
            want.append(dim if dim in op.dims else None)
        configs = costs.op_cost(op).configs
        dims = list(op.dims)
        target = tuple(tuple(a for a, w in enumerate(want) if w == d) for d in dims)
        match = [i for i, c in enumerate(configs) if c.axes == target]
        if not match:
            return None
        assign.append(match[0])
    return assign


def megatron_tp(graph: Graph, devices: int, devices_per_node: int, max_tp: int | None = None) -> int:
    """Largest tp <= min(8, node size, max_tp) dividing p and every op's Megatron dim."""
    limit = min(8, devices_per_node, devices, max_tp or devices)
    for tp in range(limit, 0, -1):
        if devices % tp == 0 and all(op.tp_dim is None or op.dims[op.tp_dim] % tp == 0 for op in graph.ops):
            return tp
    return 1


def baseline_meshes(graph: Graph, devices: int, devices_per_node: int, max_tp: int | None) -> dict[str, Mesh]:
    tp = megatron_tp(graph, devices, devices_per_node, max_tp)
    return {
        "data-parallel": named_mesh(devices, 1, devices_per_node, graph.batch_dim),
        "megatron": named_mesh(devices // tp, tp, devices_per_node, graph.batch_dim),
        "fsdp": named_mesh(devices, 1, devices_per_node, graph.batch_dim, shard_dp=True),
    }
