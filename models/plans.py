"""Whether a Plan can run a job's model: the Plan's own checks (`specs.plan.plan_refusals`) for
the spec's sizes, plus its family's reasons, and a pinned plan re-pinned on a device count.

Torch-free: it reads the spec's model section (`models/<family>/spec.py`), never the family
object, whose module imports torch. Launchers and flows ask before any worker starts, and a
process that only launches (a node's flow run) should not import torch for it.
"""

from __future__ import annotations

from parashift.specs import JobSpec
from parashift.specs.plan import Plan, plan_refusals


def job_plan_refusals(plan: Plan, spec: JobSpec) -> list[str]:
    """`plan_refusals` for the model and batch of a job spec, with its model section's own
    reasons (the section, not the family object: the family's module imports torch)."""
    m = spec.model
    if not m.sharded:  # data parallelism only: no layers, heads or sequence to split
        own = [f"the {m.family} family runs data parallelism only (dp, FSDP, HSDP): it has no sharding table for "
               f"{axis}" for axis in ("tp", "pp") if plan.degree(axis) > 1] + m.plan_refusals(plan)
        return own or plan_refusals(plan, n_layers=1, n_heads=1, seq_len=m.seq_len, global_batch=spec.training.global_batch)
    return plan_refusals(plan, n_layers=m.n_layers, n_heads=m.n_heads, seq_len=m.seq_len,
                         global_batch=spec.training.global_batch, n_kv_heads=m.n_kv_heads) + m.plan_refusals(plan)


def pinned_plan_for(spec: JobSpec, devices: int) -> tuple[Plan | None, str | None]:
    """The spec's pinned plan re-pinned on `devices` (tp and pp as pinned, dp the rest), or why
    it cannot be (then the planner chooses). (None, None) where nothing is pinned."""
    par = spec.parallelism
    if par.strategy != "pinned":
        return None, None
    try:
        plan = par.pinned(devices)
    except ValueError as error:
        return None, f"the pinned plan {dict(par.mesh or {})} cannot be re-pinned on {devices} devices: {error}"
    reasons = job_plan_refusals(plan, spec)
    if reasons:
        return None, (f"the pinned plan {dict(par.mesh or {})} re-pinned on {devices} devices as {plan.mesh} cannot "
                      f"run: {'; '.join(reasons)}")
    return plan, None
