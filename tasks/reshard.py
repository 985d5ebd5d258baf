"""plan_reshard: what the workers of a plan read from the newest checkpoint (ReconfigPlan),
published as a table artifact (for a segment: once its workers train, `tasks.views`);
`job_reshard_plan`, the same reads for the planner's options and the `reshard-plan` command."""

from __future__ import annotations

from typing import TYPE_CHECKING

from parashift.specs import JobSpec
from parashift.specs.plan import Plan
from parashift.storage import job_store, node_tier
from parashift.tasks.artifacts import artifact_key
from parashift.tasks.credentials import environment, storage_environment
from parashift.tasks.records import ReshardSummary
from parashift.tasks.retry import retry_if_it_may_help
from prefect import task
from prefect.artifacts import create_table_artifact
from prefect.logging import get_run_logger

if TYPE_CHECKING:
    from parashift.ptc.reconfig import ReconfigPlan


def newest_committed_step(spec: JobSpec) -> int:
    """The newest step whose manifest is committed (0: none), from one listing, nothing read:
    where a run resumes (the workers fall back to an older one if it does not verify)."""
    with environment(storage_environment(spec)):
        steps = job_store(spec).manifest_steps()
    return steps[-1] if steps else 0


def job_reshard_plan(spec: JobSpec, plan: Plan, held_step: int | None = None,
                     step: int | None = None) -> ReconfigPlan | None:
    """What the job's workers under `plan` would read from its newest checkpoint (or the one of
    `step`), from node-local tiers and from the store; None when nothing is committed yet. The
    job's Layout comes from the trainer (a model on the meta device); the reads from its
    manifest alone (`ptc.reshard_plan`: no process group, no torch.distributed runtime).
    `held_step`: a step the warm workers hold, not saved: its pending manifest is what they
    restore, from memory. `step`: the committed step a segment restored (a view made once it
    trains: by then it may have committed newer ones)."""
    import torch
    from parashift.ptc import reshard_plan
    from parashift.storage import CheckpointNotFound, MalformedManifest
    from parashift.trainer.layout import rng_state_bytes, state_layout

    nodes = spec.resources.nodes
    tier = node_tier(spec.storage.local_tier, "local") if nodes is None or spec.storage.local_tier else None
    layout = state_layout(plan, spec.model, rng_state_bytes(torch.device(spec.resources.kind)))
    store = job_store(spec)
    pending = committed = None
    if held_step is not None:
        try:
            pending = store.parse_manifest(held_step, store.read_pending_bytes(held_step))
        except (CheckpointNotFound, MalformedManifest):  # the workers fall back to the newest commit too
            pending = None
    elif step is not None:
        try:
            committed = store.load_manifest(step)
        except (CheckpointNotFound, MalformedManifest):  # nothing there (a fresh start): nothing was read
            return None
    return reshard_plan(store, layout, manifest=pending or committed, tier=tier if pending is None else None,
                        nodes=nodes)


@task(name="plan-reshard", retries=2, retry_delay_seconds=2, retry_condition_fn=retry_if_it_may_help)
def plan_reshard(spec: JobSpec, plan: Plan, held_step: int | None = None,
                 step: int | None = None, warm: bool = False) -> ReshardSummary | None:
    """Compute (without starting anything) each new rank's reads from the newest committed
    checkpoint (or the one of `step`, or the pending manifest of `held_step`, which warm
    workers hold); None when there is none, or when `held_step` has no pending manifest yet (a
    failure's survivors hold it). The workers then execute exactly these reads (those a live
    rank holds from its memory). `warm`: the segment's workers held the step before it, so
    what they hold comes from their memory, which this plan does not see (the start line
    counts it)."""
    with environment(storage_environment(spec)):
        if held_step is not None and held_step not in job_store(spec).pending_steps():
            # Held by the survivors of a failure: nothing describes that step until the next
            # segment's ranks do (trainer.checkpoint.live), and they read none of it from storage.
            get_run_logger().info("step %d is held whole in the surviving workers' memory: the next segment "
                                  "describes it and restores it from there", held_step)
            return None
        reconfig = job_reshard_plan(spec, plan, held_step, step)
    if reconfig is None:
        return None
    totals = reconfig.totals()
    summary = ReshardSummary(step=reconfig.step, devices=plan.devices, **{k: totals[k] for k in ReshardSummary.totals()})
    held = held_step is not None and reconfig.step == held_step  # not saved: every byte comes from live workers
    where = ("from the warm workers' memory: the step is not saved" if held
             else f"{summary.bytes_local / 1e6:.1f} MB from this node's tier" + (
                 "; the warm workers serve what they hold from memory instead, the rest is read" if warm else ""))
    get_run_logger().info("moving step %d onto %s (all ranks): %.1f MB read for %.1f MB needed in %d requests (%s)",
                          reconfig.step, plan.describe(), summary.bytes_read / 1e6, summary.bytes_needed / 1e6,
                          summary.requests, where)
    create_table_artifact(
        key=artifact_key(spec.job_id, f"reshard-{plan.devices}"),
        table=reconfig.summary(),
        description=(f"Checkpoint at step {reconfig.step} onto {plan.describe()}: {summary.bytes_read:,} bytes read for "
                     f"{summary.bytes_needed:,} needed, {summary.requests} ranged requests, "
                     f"{summary.bytes_local:,} from the node-local tier"),
    )
    return summary
