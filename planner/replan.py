"""Re-planning a running job: the next Plan is the one that finishes the remaining steps first,
counting the one-time cost of moving the checkpoint onto it, not step time alone.

Each option's move is what its ReconfigPlan reads (exact bytes, computed from the committed
manifest before anything starts) over the store's read bandwidth. A plan that keeps more of
the saved layout reads less: after a tensor-parallel checkpoint, data parallelism reads the
whole state on every rank, tensor parallelism half of it per rank at tp 2. Over few remaining
steps (or from a slow store) the cheaper move can win over a faster step.
"""

from __future__ import annotations

from dataclasses import dataclass

from parashift.specs.plan import Plan


@dataclass(frozen=True)
class Option:
    plan: Plan
    step_s: float  # estimated
    move_bytes: int  # the ReconfigPlan's bytes read, all ranks

    def move_s(self, read_bytes_per_s: float) -> float:
        return self.move_bytes / read_bytes_per_s

    def total_s(self, remaining_steps: int, read_bytes_per_s: float) -> float:
        return self.step_s * remaining_steps + self.move_s(read_bytes_per_s)


def pick(options: list[Option], remaining_steps: int, read_bytes_per_s: float) -> Option:
    """The option that finishes first (ties: the faster step)."""
    if not options:
        raise ValueError("no plan to choose from")
    if read_bytes_per_s <= 0:
        raise ValueError(f"read bandwidth must be positive, got {read_bytes_per_s}")
    return min(options, key=lambda o: (o.total_s(remaining_steps, read_bytes_per_s), o.step_s))


def comparison(options: list[Option], remaining_steps: int, read_bytes_per_s: float) -> list[dict[str, object]]:
    """One row per option, for the plan artifact."""
    chosen = pick(options, remaining_steps, read_bytes_per_s)
    fastest = min(options, key=lambda o: o.step_s)
    return [{"mesh": str(o.plan.mesh), "strategy": o.plan.strategy, "step_s": round(o.step_s, 6),
             "move_mb": round(o.move_bytes / 1e6, 3), "move_s": round(o.move_s(read_bytes_per_s), 4),
             "remaining_steps": remaining_steps,
             "total_s": round(o.total_s(remaining_steps, read_bytes_per_s), 4),
             "chosen": o is chosen, "fastest_step": o is fastest} for o in options]
