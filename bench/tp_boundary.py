"""What the DTensor boundary of a tensor-parallel linear costs: forward + backward through each
parameter's local shard, torch's `DTensor.to_local` against `trainer.tp_styles.local_shard`,
with a plain-tensor loop as the floor. Tiny (8 x 8) weights, so the matmuls cost next to
nothing and what is left is the conversion; one process, a 1-rank "tp" mesh (gloo).

    OMP_NUM_THREADS=1 python -m bench.tp_boundary [--params 72] [--steps 200] [--rounds 5]

Last line: one JSON object, milliseconds per step (all `--params` conversions and their
backwards), medians over rounds, and the per-round values.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from parashift.trainer.tp_styles import local_shard
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor


def step_ms(params: list[torch.nn.Parameter], to_plain: Callable[[torch.Tensor], torch.Tensor], steps: int) -> float:
    x = torch.randn(4, 8)

    def step() -> None:
        total = sum(F.linear(x, to_plain(p)).sum() for p in params)
        total.backward()  # type: ignore[union-attr]
        for p in params:
            p.grad = None

    for _ in range(10):
        step()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - started) / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--params", type=int, default=72, help="tensor-parallel parameters (bench.train_throughput's tp GPT has 72, its Llama 42)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29517"), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    sharded = [torch.nn.Parameter(distribute_tensor(torch.randn(8, 8), mesh, [Shard(0)])) for _ in range(args.params)]
    plain = [torch.nn.Parameter(torch.randn(8, 8)) for _ in range(args.params)]
    ways = {
        "to_local": (sharded, lambda p: p.to_local()),
        "local_shard": (sharded, local_shard),
        "plain": (plain, lambda p: p),
    }
    rounds: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.rounds):  # alternating, so drift on a shared machine hits each alike
        for name, (params, to_plain) in ways.items():
            rounds[name].append(step_ms(params, to_plain, args.steps))
    dist.destroy_process_group()
    medians = {name: statistics.median(values) for name, values in rounds.items()}
    for name, value in medians.items():
        print(f"{name}: {value:.2f} ms per step")
    print(json.dumps({"benchmark": "tp_boundary", "params": args.params, "ms_per_step": medians,
                      "boundary_ms": {name: medians[name] - medians["plain"] for name in ("to_local", "local_shard")},
                      "rounds": rounds}))


if __name__ == "__main__":
    main()
