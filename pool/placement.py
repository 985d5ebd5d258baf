"""Which nodes each job of a pool over nodes runs on: whole nodes, as many as its device count
needs, moving as little as possible. Pure, like the allocator it follows.

A job across nodes runs the same devices on each of its nodes (docs/nodes.md), and two jobs on
one node would share its devices (on GPUs, the same device indices). So in a pool over nodes the
unit is a node: the allocator gives each job a multiple of the node size (`pool_counts`), and
`place` turns those counts into node lists.

- A job keeps the nodes it runs on: one that keeps its count keeps its nodes, one that shrinks
  keeps the first of them (what a device-count event keeps, `specs.elastic.apply_change`), so
  it re-plans without moving a byte it does not have to.
- A job that grows, or starts, takes free nodes in the pool's order.

The allocator never gives out more than the pool, so every job finds its nodes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from parashift.specs import JobSpec


def misfit(spec: JobSpec, nodes: Sequence[str] | None, devices_per_node: int | None) -> str | None:
    """Why a job cannot be placed by a pool (over `nodes`, or one machine's: None), naming the
    spec's field; None when it can."""
    res = spec.resources
    if spec.elasticity:  # its own scripted counts would fight the pool's share, and take others' devices
        return "elasticity: a pool sets its jobs' device counts; leave it out"
    if nodes is None or devices_per_node is None:
        return None
    if res.nodes is not None:
        return "resources.nodes: a pool over nodes places its jobs; leave it out"
    if res.devices_per_node not in (None, devices_per_node):
        return f"resources.devices_per_node: this pool's nodes have {devices_per_node} (got {res.devices_per_node})"
    return None


def pool_counts(counts: Sequence[int], devices_per_node: int) -> list[int]:
    """Of a job's device counts, those a pool over nodes can give: whole nodes."""
    return [n for n in counts if n % devices_per_node == 0]


def whole_nodes(devices: int, devices_per_node: int) -> int:
    """The nodes that hold at least `devices` (a request or a minimum rounded up to whole nodes)."""
    return -(-devices // devices_per_node)


def place(devices: Mapping[str, int], running_on: Mapping[str, Sequence[str]], nodes: Sequence[str],
          devices_per_node: int) -> dict[str, list[str]]:
    """Each job with devices (a multiple of `devices_per_node`) -> its nodes. `running_on`: the
    nodes each job has now (jobs not in `devices`, or at 0, give theirs up). ValueError when
    the counts do not fit the nodes (the allocator's promise broken)."""
    wanted: dict[str, int] = {}
    for job, n in devices.items():
        if n % devices_per_node:
            raise ValueError(f"{job}: {n} devices is not a whole number of {devices_per_node}-device nodes")
        if n:
            wanted[job] = n // devices_per_node
    if sum(wanted.values()) > len(nodes):
        raise ValueError(f"{sum(wanted.values())} nodes given out, the pool has {len(nodes)}")
    placed: dict[str, list[str]] = {}
    taken: set[str] = set()
    for job, k in wanted.items():  # first what stays: a prefix of the nodes it has
        kept = [node for node in running_on.get(job, ()) if node in nodes and node not in taken][:k]
        placed[job] = kept
        taken.update(kept)
    free = [node for node in nodes if node not in taken]
    for job, k in wanted.items():  # then the growth, from the free nodes in the pool's order
        more, free = free[: k - len(placed[job])], free[k - len(placed[job]):]
        placed[job] = placed[job] + more
    return placed
