"""A torchrun program that measures collectives and point-to-point sends on the job's own
workers (the planner's communication model: `planner.comm.measure_collectives`) and reports it
as one worker event.

    torchrun --standalone --nproc-per-node N -m trainer.measure_comm --kind cpu
"""

from __future__ import annotations

import argparse

import torch.distributed as dist

from planner.comm import measure_collectives
from trainer import metrics
from trainer.worker import init_distributed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--kind", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--devices-per-node", type=int, default=None)
    args = parser.parse_args(argv)
    rank, world_size, _ = init_distributed(args.kind)
    if world_size < 2:
        raise SystemExit("measuring collectives needs at least 2 workers")
    comm = measure_collectives(devices_per_node=args.devices_per_node)
    if rank == 0:
        metrics.emit("comm_model", comm=comm.model_dump(mode="json"))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
