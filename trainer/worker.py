"""The program torchrun starts on every device: reads the spec and the Plan, then runs this
rank's segment step by step (`trainer.trainer.Trainer`: setup -> restore -> start -> train ->
finish). Warm workers (`launcher.warm_pool`) call `main` once per job.

Every plan takes one path: the ("pp", "dp", "tp") mesh (`trainer.mesh`), this rank's pipeline
stage (the whole model without "pp"), `trainer.parallel.parallelize` (DTensor tensor and
sequence parallelism, activation checkpointing, then FSDP2's replicate or fully_shard on dp),
and with "pp" the `trainer.pipeline` schedule (`parallelism.pp_schedule`: 1F1B or GPipe)
over plan.micro_batches micro-batches.

    torchrun --standalone --nproc-per-node N -m trainer.worker --spec spec.json --plan plan.json
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from pathlib import Path

from parashift.models.plans import job_plan_refusals
from parashift.specs import JobSpec
from parashift.specs.plan import Plan
from parashift.trainer.trainer import run
from parashift.trainer.warm import is_warm_worker


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spec", type=Path, required=True, help="the validated JobSpec as JSON")
    parser.add_argument("--plan", type=Path, required=True, help="the Plan as JSON")
    parser.add_argument("--until-step", type=int, default=None, help="checkpoint and stop at this step")
    return parser.parse_args(argv)

def seconds_since_process_start() -> float | None:
    """How long this process has existed (Linux /proc; None elsewhere): its interpreter start
    and imports, the largest part of a relaunch on a small machine."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return uptime - ticks / os.sysconf("SC_CLK_TCK")


class Phases:
    """Where a (re)launch's time goes, phase by phase, for the start event: the interpreter's
    start and imports first (the largest part on a small machine), then each phase of `main`."""

    def __init__(self) -> None:
        # A warm worker (launcher.warm_pool) booted long before this job: nothing of it is this launch's.
        self.seconds: dict[str, float | None] = {"boot_s": 0.0 if is_warm_worker() else seconds_since_process_start()}
        self._mark = time.perf_counter()

    def done(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = round(now - self._mark, 4)
        self._mark = now


def main(argv: list[str] | None = None) -> int:
    phases = Phases()
    args = parse_args(argv)
    # The rank in every record: the run log interleaves every worker's lines.
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s rank{os.environ.get('RANK', '0')} %(name)s: %(message)s")
    # The trainer reports each commit ("checkpoint step N committed: ...") and prune as its own
    # lines; the store's would say each a second time in the run log.
    logging.getLogger("parashift.storage").setLevel(logging.WARNING)
    spec = JobSpec.model_validate_json(args.spec.read_text())
    plan = Plan.model_validate_json(args.plan.read_text())
    refusals = job_plan_refusals(plan, spec)
    if refusals:
        raise SystemExit(f"cannot execute plan with mesh {plan.mesh}: " + "; ".join(refusals))
    return run(spec, plan, args.until_step, phases)


if __name__ == "__main__":
    raise SystemExit(main())
