"""The cost model: per-op cost of each configuration, per-edge cost of each pair of configurations.

PaSE's decomposition (Elango 2021, section III): a strategy costs the sum over ops of compute and
the collectives inside the op, plus the sum over edges of layout conversion. Here:

- compute: forward + backward (3x forward FLOPs) over the op's share of the iteration space,
  on a roofline of the device's GEMM rate (times the wave efficiency of the op's local GEMM
  shape) and memory bandwidth, plus the host's fixed overhead per op; on a device the host
  feeds asynchronously (CUDA) the larger of device and host time instead of their sum;
- collectives inside the op: a tensor that lacks a split dim is a partial sum over the devices
  splitting it — the output in the forward pass, each input's and weight's gradient in the
  backward pass — so it is all-reduced over that group (weight gradients: data-parallel sync);
- layout conversion: the bytes a device must receive to hold its block in the consumer's layout
  (forward) and the producer's layout for the gradient (backward);
- optimizer step: once per step, reading and writing the parameter state of the device's shard
  (bandwidth-bound; counted with the gradient sync, the other once-per-step term);
- memory per device: parameter state (weights, grads, Adam) of its shard, the activations each
  op's backward keeps (`Op.saved`, per micro-batch in flight) and, under autocast, the
  low-precision weight copies the GEMMs keep (`Graph.weight_cast_bytes`, once per step).
- sharded data parallelism (`Mesh.shard_dp`, FSDP): parameter state and the optimizer step
  divided over "dp"; the weight gradient's all-reduce over "dp" becomes FSDP's traffic: the
  cost of one all-gather of each weight (`OpCost.gather`) and its gradient's reduce-scatter
  once per step, and the bytes of the unsharded weight and gradient (`unsharded_weight`,
  `unsharded_grad`). How many gathers a step makes and which unsharded tensors stay in memory
  depend on the schedule (micro-batches, pipeline, reshard after forward): `problem.Weights`
  decides. FSDP2 issues each collective once per unit (a block, or the root's own weights), so
  a weight pays its share of the unit's latency and of the per-collective CPU cost (half a
  sharded op's overhead: a tensor-parallel op runs about two collectives).

Tables are cached by op signature, so identical layers cost one computation.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from math import prod

import numpy as np
from parashift.planner.comm import CommModel, default_comm
from parashift.planner.configs import Config, Mesh, named_mesh, op_configs
from parashift.planner.graph import Edge, Graph, Op, Saved
from parashift.planner.profile import DEFAULT_DEVICES, DeviceModel

# Ops that run at the GEMM rate; the rest are bandwidth-bound.
GEMM_KINDS = frozenset({"matmul", "conv", "attention"})


def gemm_output_dims(op: Op) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]] | None:
    """The output dims of an op's GEMM as (batch, rows, columns): the left operand is the first
    input, the right one the first weight (else the second input); output dims in both are the
    batch, in the left only the rows, in the right only the columns. None when the op has one
    operand only (fused attention tiles its own way)."""
    right = op.params[0] if op.params else (op.inputs[1] if len(op.inputs) > 1 else None)
    if not op.inputs or right is None:
        return None
    left = op.inputs[0]
    out = op.output
    return (tuple(d for d in out if d in left and d in right), tuple(d for d in out if d in left and d not in right),
            tuple(d for d in out if d in right and d not in left))


@dataclass
class OpCost:
    """Arrays over an op's configurations."""

    configs: list[Config]
    compute: np.ndarray  # s, forward + backward, one evaluation (micro-batch)
    comm: np.ndarray  # s, activation collectives inside the op, one evaluation
    grad_comm: np.ndarray  # s, once per step: the weight gradients' all-reduce (or reduce-scatter)
    param_mem: np.ndarray  # bytes of parameter state held
    act_mem: np.ndarray  # bytes of activations saved for the backward pass, one evaluation
    cast_mem: np.ndarray  # bytes of low-precision weight copies kept for backward, once per step
    recompute_mem: np.ndarray  # bytes held once at the backward's peak: a checkpointed layer's recomputation
    # (its share of one layer) and the op's own transients (Op.transient)
    # Sharded dp (FSDP) only, else zeros: one all-gather of the weights, s; bytes of the
    # unsharded weights and of their unsharded gradients (held as problem.Weights says).
    gather: np.ndarray
    unsharded_weight: np.ndarray
    unsharded_grad: np.ndarray
    # Replicated dp only, else zeros: the bytes of FSDP2 `replicate`'s unsharded copy of the
    # weights, which a pipeline stage keeps for the whole step (measured: trainer.memory_probe).
    replica_weight: np.ndarray
    # s, once per step: the optimizer's update, reading and writing the local shard's state
    # (device work, not communication: it is there on one device too).
    update: np.ndarray


def largest_share(n: int, c: int) -> int:
    """The most items of `n` split `c` ways that one rank holds (shares differ by one at most)."""
    return -(-n // c)


def rank_shares(op: Op, cfg: Config) -> dict[str, float]:
    """Per op dim, what a configuration divides it by for the busiest rank: the split count, or
    for a batch split unevenly over data parallelism (`configs._shares`: 16 over 3 is 6, 5, 5)
    the size over the largest share (16 / 6), so every per-rank quantity is the slowest rank's."""
    return {d: c if n % c == 0 else n / largest_share(n, c)
            for (d, n), c in zip(op.dims.items(), cfg.counts, strict=True)}


class CostModel:
    """Cost tables of one graph on one mesh, cached by op signature."""

    def __init__(self, graph: Graph, device: DeviceModel, comm: CommModel, mesh: Mesh,
                 signatures: Mapping[str, str] | None = None, ops: Mapping[str, Op] | None = None) -> None:
        """`signatures`: op name -> a key equal for ops that cost the same (default: `Op.signature`);
        `ops`: op name -> op, for edges (default: the graph's; may resolve lazily, planner/outer.py)."""
        self.graph, self.device, self.comm, self.mesh = graph, device, comm, mesh
        self._ops: dict[str, OpCost] = {}
        self._edges: dict[tuple[str, str, int], np.ndarray] = {}
        self._sig = signatures if signatures is not None else {op.name: op.signature() for op in graph.ops}
        self._by_name = ops if ops is not None else {op.name: op for op in graph.ops}
        # FSDP units (a block, or the root's ops outside blocks): how many ops with weights each
        # has, so that an op pays its share of the unit's collectives. Block tags of identical
        # layers hold the same ops, so ops of equal signature get equal shares.
        self._unit_ops: dict[str | None, int] = {}
        for op in graph.ops:
            if op.params:
                self._unit_ops[op.block] = self._unit_ops.get(op.block, 0) + 1

    def signature(self, name: str) -> str:
        return self._sig[name]

    def op_cost(self, op: Op) -> OpCost:
        key = self._sig.get(op.name) or op.signature()
        if key not in self._ops:
            self._ops[key] = self._build_op(op)
        return self._ops[key]

    def edge_cost(self, edge: Edge) -> np.ndarray:
        # Keyed by the ends' names: their ops are looked up (a context resizes them on first
        # use, planner/outer.py) only to build a table, not for each of a search's many reads.
        key = (self._sig[edge.src], self._sig[edge.dst], edge.slot)
        table = self._edges.get(key)
        if table is None:
            table = self._edges[key] = self._build_edge(self._by_name[edge.src], self._by_name[edge.dst], edge.slot)
        return table

    def _dp_axis(self) -> int | None:
        """Index of the "dp" axis when it shards parameter state (FSDP), else None."""
        return self.mesh.names.index("dp") if self.mesh.shard_dp and "dp" in self.mesh.names else None

    def _fsdp(self, op: Op, cfg: Config, weight: tuple[str, ...]) -> tuple[float, float]:
        """FSDP's traffic for one weight over the sharded "dp" axis: seconds of one all-gather
        of it and of one reduce-scatter of its gradient."""
        dp_axis = self._dp_axis()
        if dp_axis is None:
            return 0.0, 0.0
        local = op.numel(weight) / prod(c for d, c in rank_shares(op, cfg).items() if d in weight)
        group, intra = self.mesh.group({dp_axis})
        link = self.comm.link(intra)
        share = 1.0 / (len(op.params) * self._unit_ops.get(op.block, 1))
        fixed = share * (link.latency_s + self.device.sharded_op_overhead_s / 2)
        ring = (group - 1) / group / link.bandwidth_Bps
        gathered = self.graph.gather_bytes or self.graph.act_bytes
        return fixed + ring * local * gathered, fixed + ring * local * self.graph.grad_bytes

    def _allreduce(self, op: Op, cfg: Config, tensor: tuple[str, ...], elem_bytes: int, bucketed: bool = False) -> float:
        """All-reduce of a tensor that is a partial sum over the axes splitting dims it lacks
        (`bucketed`: a weight gradient, fused with others into buckets; over a sharded "dp"
        axis that part is FSDP's, `_fsdp`)."""
        axes = {a for d, ax in zip(op.dims, cfg.axes, strict=True) if d not in tensor for a in ax}
        dp_axis = self._dp_axis() if bucketed else None
        if dp_axis is not None:  # FSDP gathers and reduce-scatters every weight, whatever the op splits
            axes.discard(dp_axis)
        if not axes:
            return 0.0
        group, intra = self.mesh.group(axes)
        local = op.numel(tensor) / prod(c for d, c in rank_shares(op, cfg).items() if d in tensor)
        reduce = self.comm.bucketed_all_reduce if bucketed else self.comm.all_reduce
        return reduce(local * elem_bytes, group, intra)

    def _build_op(self, op: Op) -> OpCost:
        g, dev = self.graph, self.device
        configs = op_configs(op, self.mesh)
        n = len(configs)
        compute, comm, grad_comm, update = np.zeros(n), np.zeros(n), np.zeros(n), np.zeros(n)
        param_mem, act_mem, cast_mem, recompute_mem = np.zeros(n), np.zeros(n), np.zeros(n), np.zeros(n)
        # Forward once, backward twice its FLOPs; a recomputed op runs its forward once more.
        passes = 4.0 if op.recompute else 3.0
        gather, unsharded_weight, unsharded_grad, replica_weight = np.zeros(n), np.zeros(n), np.zeros(n), np.zeros(n)
        rate = dev.matmul_flops if op.kind in GEMM_KINDS else float("inf")
        gemm = gemm_output_dims(op) if op.kind in GEMM_KINDS else None
        dp_axis = self._dp_axis()
        replicated_dp = dp_axis is None and "dp" in self.mesh.names
        tp_axis = self.mesh.names.index("tp") if "tp" in self.mesh.names else None
        state_share = 1 if dp_axis is None else self.mesh.sizes[dp_axis]  # FSDP: each rank holds 1/dp
        for i, cfg in enumerate(configs):
            split = rank_shares(op, cfg)

            def local(tensor: tuple[str, ...], split: dict[str, int] = split) -> float:
                return op.numel(tensor) / prod(split[d] for d in tensor)

            share = prod(split.values())
            act = sum(local(t) for t in op.inputs) + local(op.output)
            params = sum(local(t) for t in op.params)
            moved = passes * g.act_bytes * (act + params)
            sharded = any(c > 1 for d, c in split.items() if d != g.batch_dim)
            host = dev.op_overhead_s + (dev.sharded_op_overhead_s if sharded else 0.0)
            efficiency = 1.0
            if gemm is not None:
                batch, rows, cols = (prod(largest_share(op.dims[d], c) for d, c in zip(op.dims, cfg.counts, strict=True)
                                          if d in dims) for dims in gemm)
                efficiency = dev.gemm_efficiency(batch, rows, cols)
            device_s = max(passes * op.flops / share / (rate * efficiency), moved / dev.memory_Bps)
            compute[i] = max(device_s, host) if dev.host_async else device_s + host
            forward = self._allreduce(op, cfg, op.output, g.act_bytes)
            comm[i] = forward * (2.0 if op.recompute else 1.0) + sum(
                self._allreduce(op, cfg, t, g.act_bytes) for t in op.inputs)
            grad_comm[i] = sum(self._allreduce(op, cfg, t, g.grad_bytes, bucketed=True) for t in op.params)
            for t in op.params:
                all_gather, reduce_scatter = self._fsdp(op, cfg, t)
                gather[i] += all_gather
                grad_comm[i] += reduce_scatter
            if dp_axis is not None:
                unsharded_weight[i] = (g.gather_bytes or g.act_bytes) * params
                unsharded_grad[i] = g.grad_bytes * params
            elif replicated_dp:  # FSDP2's `replicate`: each weight's unsharded copy beside it
                replica_weight[i] = (g.gather_bytes or g.act_bytes) * params
            # The optimizer step reads and writes the parameter state of the local shard once:
            # replicas (dp, or ops replicated over tp) each pay it again.
            update[i] = 2.0 * g.param_state_bytes * params / state_share / dev.memory_Bps
            param_mem[i] = g.param_state_bytes * params / state_share
            kept = op.saved if op.saved is not None else (Saved(dims=op.output, bytes=g.act_bytes),)
            act_mem[i] = sum(t.bytes * local(t.dims) for t in kept)
            if op.gathered_input and tp_axis is not None and any(
                    tp_axis in axes for d, axes in zip(op.dims, cfg.axes, strict=True) if d in (op.tp_dims or ())):
                act_mem[i] += g.act_bytes * local(op.inputs[0])  # the all-gather's output, kept by selective AC
            if op.kind in GEMM_KINDS and op.params:  # the GEMM's weight operand (params[0]); biases stay fp32
                cast_mem[i] = g.weight_cast_bytes * local(op.params[0])
            if op.checkpointed:  # one layer's worth live at a time, casts made again with it
                again = sum(t.bytes * local(t.dims) for t in op.recomputed) + cast_mem[i]
                recompute_mem[i], cast_mem[i] = again * g.recompute_share / g.recompute_layers, 0.0
            recompute_mem[i] += sum(t.bytes * local(t.dims) for t in op.transient)
        return OpCost(configs, compute, comm, grad_comm, param_mem, act_mem, cast_mem, recompute_mem, gather,
                      unsharded_weight, unsharded_grad, replica_weight, update)

    def _build_edge(self, src: Op, dst: Op, slot: int) -> np.ndarray:
        """Seconds to convert src's output layout to dst's input layout, and the gradient back."""
        s_cfg, d_cfg = self.op_cost(src).configs, self.op_cost(dst).configs
        s_dims, d_dims = src.output, dst.inputs[slot]
        numel = src.numel(s_dims)
        s_pos = [list(src.dims).index(d) for d in s_dims]
        d_pos = [list(dst.dims).index(d) for d in d_dims]
        ns, nd = len(s_cfg), len(d_cfg)
        p_src = np.ones(ns, dtype=np.int64)  # blocks per tensor in each layout
        p_dst = np.ones(nd, dtype=np.int64)
        p_max = np.ones((ns, nd), dtype=np.int64)  # blocks of the common refinement
        nested = np.ones((ns, nd), dtype=bool)
        mask_s = np.zeros(ns, dtype=np.int64)  # mesh axes used on the tensor, as bits
        mask_d = np.zeros(nd, dtype=np.int64)
        for sp, dp in zip(s_pos, d_pos, strict=True):
            cs = np.array([c.counts[sp] for c in s_cfg], dtype=np.int64)
            cd = np.array([c.counts[dp] for c in d_cfg], dtype=np.int64)
            p_src *= cs
            p_dst *= cd
            p_max *= np.maximum(cs[:, None], cd[None, :])
            ax_s = [c.axes[sp] for c in s_cfg]
            ax_d = [c.axes[dp] for c in d_cfg]
            mask_s |= np.array([sum(1 << a for a in ax) for ax in ax_s], dtype=np.int64)
            mask_d |= np.array([sum(1 << a for a in ax) for ax in ax_d], dtype=np.int64)
            if not self.mesh.aligned:
                # Blocks nest only when one layout's axes are a prefix of the other's; otherwise
                # some device holds none of what it needs along this dim (a conservative bound).
                uniq_s = sorted(set(ax_s))
                uniq_d = sorted(set(ax_d))
                table = np.array([[a[: len(b)] == b or b[: len(a)] == a for b in uniq_d] for a in uniq_s])
                i_s = np.array([uniq_s.index(a) for a in ax_s])
                i_d = np.array([uniq_d.index(b) for b in ax_d])
                nested &= table[np.ix_(i_s, i_d)]
        nbytes = float(numel * self.graph.act_bytes)
        # Received fraction: own block minus the overlap with what the device already holds.
        over = np.where(nested, 1.0 / p_max, 0.0)
        recv_fwd = np.where(nested & (p_max == p_dst[None, :]), 0.0, nbytes * (1.0 / p_dst[None, :] - over))
        recv_bwd = np.where(nested & (p_max == p_src[:, None]), 0.0, nbytes * (1.0 / p_src[:, None] - over))
        union = mask_s[:, None] | mask_d[None, :]
        intra = np.zeros_like(union, dtype=bool)
        for m in np.unique(union):
            axes = {a for a in range(len(self.mesh.sizes)) if int(m) >> a & 1}
            intra[union == m] = self.mesh.group(axes)[1]
        out = np.zeros((ns, nd))
        for level in (True, False):
            link = self.comm.link(level)
            sel = intra == level
            for recv in (recv_fwd, recv_bwd):
                out += np.where(sel & (recv > 0), link.latency_s + recv / link.bandwidth_Bps, 0.0)
        return out


def data_parallel_activation_bytes(graph: Graph, dp: int = 1) -> float:
    """Bytes one device keeps for backward with the batch split `dp` ways and nothing else
    split: what each op's backward keeps for one evaluation plus autocast's weight copies (what
    trainer.memory.kept_for_backward measures on the trainer's model)."""
    costs = CostModel(graph, DEFAULT_DEVICES["cpu"], default_comm("cpu"), named_mesh(dp, 1, batch_dim=graph.batch_dim))
    total = 0.0
    for op in graph.ops:
        cost = costs.op_cost(op)
        only_batch = next(i for i, cfg in enumerate(cost.configs)
                          if all(c == 1 for d, c in zip(op.dims, cfg.counts, strict=True) if d != graph.batch_dim))
        total += float(cost.act_mem[only_batch] + cost.cast_mem[only_batch])
    return total
