"""plan_parallelism: the Plan the workers execute, published as a table artifact; PlansAhead:
the same for the counts a job may move to, computed while it trains."""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from dataclasses import dataclass, field

from parashift.models.plans import job_plan_refusals, pinned_plan_for
from parashift.planner.measured import MeasuredProfile, measured_options, plan_measured
from parashift.planner.profile import ModelProfile, peak_flops
from parashift.planner.replan import Option, comparison, pick
from parashift.planner.search import plan_model, plan_options
from parashift.specs import JobSpec
from parashift.specs.plan import Plan
from parashift.specs.words import counted, gib
from parashift.storage import default_read_bytes_per_s
from parashift.tasks.artifacts import artifact_key
from parashift.tasks.credentials import environment, storage_environment
from parashift.tasks.profile import NeedsMeasurement, ensure_profile, load_profile
from parashift.tasks.records import ModelSummary
from parashift.tasks.reshard import job_reshard_plan
from prefect import task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.logging import get_run_logger


def choose_plan(spec: JobSpec, searched: Plan, devices: int) -> Plan:
    """The planner's plan when the spec lets it choose and the trainer can run it; data parallel otherwise,
    carrying the planner's estimates so the artifact shows what was left on the table.

    The planner searches only layouts the trainer executes (gpt_graph declares them), so its
    plans for GPT graphs pass `job_plan_refusals`; the check stays as a safety net against the
    planner and the trainer drifting apart, and says so when it triggers."""
    if spec.parallelism.strategy == "auto":
        reasons = job_plan_refusals(searched, spec)
        if not reasons:
            return searched
        note = (f"planner's choice {searched.mesh} is refused by the trainer ({'; '.join(reasons)}), although the "
                "planner searches only executable layouts: planner and trainer disagree (a bug); data parallel instead")
    else:
        note = (f"strategy data-parallel; the planner's choice would be {searched.describe()} at "
                f"{searched.estimated_step_s:.4g} s per step")
    return Plan.data_parallel(
        devices,
        estimated_step_s=searched.baselines.get("data-parallel"),
        baselines=searched.baselines,
        notes=[*searched.notes, note],
    )


def pinned_with_estimate(plan: Plan, profile: ModelProfile | MeasuredProfile, spec: JobSpec) -> Plan:
    """The pinned plan with the cost model's step time and memory where it can estimate them."""
    from parashift.planner.pinned import estimate

    if isinstance(profile, MeasuredProfile):
        return plan
    par = spec.parallelism
    try:
        result = estimate(profile, plan, par.mixed_precision if par.precision == "bf16" else None)
    except ValueError:  # a layout the estimate does not cover (HSDP): the plan runs unestimated
        return plan
    return plan.model_copy(update={"estimated_step_s": result.time_s, "memory_per_device_bytes": int(result.memory_bytes)})


def with_memory_choices(spec: JobSpec, plan: Plan) -> Plan:
    """The plan with the spec's pinned memory choices: its activation checkpointing where the
    spec names one (else the planner's, 'none' for a data-parallel plan), and how bf16 compute
    is had (autocast, or FSDP2's mixed-precision policy)."""
    par = spec.parallelism
    ac = plan.activation_checkpointing if par.activation_checkpointing == "auto" else par.activation_checkpointing
    mixed = par.mixed_precision if par.precision == "bf16" else "autocast"
    return plan.model_copy(update={"activation_checkpointing": ac, "mixed_precision": mixed})


def cheapest_to_continue(spec: JobSpec, options: list[Plan], step: int,
                         read_bytes_per_s: float | None) -> tuple[Option, list[dict[str, object]]] | None:
    """Among executable options, the plan that finishes the remaining steps first counting the
    move of the newest checkpoint onto it; None when nothing is committed (nothing to move)."""
    moves = []
    for plan in options:
        reshard = job_reshard_plan(spec, plan)
        if reshard is None:
            return None
        moves.append(Option(plan, plan.estimated_step_s or float("inf"), reshard.totals()["bytes_read"]))
    remaining = max(spec.training.steps - step, 0)
    bandwidth = read_bytes_per_s or default_read_bytes_per_s(spec.storage.url)
    return pick(moves, remaining, bandwidth), comparison(moves, remaining, bandwidth)


# Searches already made in this process, by everything their result depends on: a job that
# comes back to a device count (4 -> 2 -> 4) re-plans without searching again (0.5 s of a
# change's downtime for the trace benchmark's 4-device GPT).
_SEARCHED: dict[tuple[object, ...], Plan] = {}
_SEARCHED_MAX = 64
_SEARCHED_LOCK = threading.Lock()  # the flow and its plans made ahead (PlansAhead) share it


def _search(spec: JobSpec, profile: ModelProfile | MeasuredProfile, devices: int, limit: int | None) -> Plan:
    """The planner's choice for `devices` (remembered: the search is deterministic)."""
    par, train = spec.parallelism, spec.training
    ac_modes = par.ac_searched()
    key = (hashlib.sha256(profile.model_dump_json().encode()).hexdigest(), devices, limit, par.max_tp, par.max_pp,
           spec.resources.kind, par.shard_data_parallel, train.global_batch, train.micro_batch, ac_modes,
           par.mixed_precision)
    with _SEARCHED_LOCK:
        found = _SEARCHED.get(key)
    if found is None:  # two threads may search the same key at once: both get the same plan
        if isinstance(profile, MeasuredProfile):  # no op graph: the data axis's options, measured
            searched = plan_measured(profile, devices, train.global_batch, train.micro_batch, limit,
                                     shard_dp=par.shard_data_parallel, ac_modes=ac_modes,
                                     mixed_precision=par.bf16_policy())
        else:
            searched = plan_model(profile, devices, limit, par.max_tp, par.max_pp, device_kind=spec.resources.kind,
                                  shard_dp=par.shard_data_parallel, ac_modes=ac_modes,
                                  mixed_precision=par.mixed_precision)
        with _SEARCHED_LOCK:
            if len(_SEARCHED) >= _SEARCHED_MAX:
                _SEARCHED.pop(next(iter(_SEARCHED)))
            _SEARCHED[key] = found = searched
    return found.model_copy(deep=True)


@dataclass
class PreparedPlan:
    """Planning for a device count, done but for what depends on the step it resumes at: the
    pinned plan or the planner's choice, and the executable options a resuming job weighs
    against the move of its checkpoint (`finish_plan`). What `PlansAhead` computes while the
    job trains."""

    devices: int
    model: ModelSummary
    plan: Plan
    options: list[Plan]
    peak_flops: float
    said: list[tuple[int, str]] = field(default_factory=list)  # (logging level, line): logged when used


def prepare_plan(spec: JobSpec, model: ModelSummary, devices: int, with_options: bool = True) -> PreparedPlan:
    """The search for `devices` (the expensive part of planning; no Prefect, no storage writes).
    `with_options`: also the options `finish_plan` weighs for a job resuming past step 0."""
    profile = load_profile(spec, model.profile_key)
    par, train = spec.parallelism, spec.training
    said: list[tuple[int, str]] = []
    limit = par.plan_memory_bytes(profile.device.memory_bytes)  # the device less the reserve for transients
    if limit is not None:
        said.append((logging.INFO, f"planning within {limit / 2**30:.2f} GiB of each device's "
                     f"{profile.device.memory_bytes / 2**30:.2f} GiB "
                     f"({(profile.device.memory_bytes - limit) / 2**30:.2f} GiB reserved for transient buffers)"))
    pinned, refused = pinned_plan_for(spec, devices)
    if pinned is not None:
        plan = pinned_with_estimate(pinned, profile, spec)
        searched = plan
    else:
        searched = _search(spec, profile, devices, limit)
        plan = choose_plan(spec, searched, devices)
        if refused:  # pinned, but not on this many devices: said, and the planner's choice instead
            said.append((logging.WARNING, refused))
            plan = plan.model_copy(update={"notes": [*plan.notes, refused]})
    options: list[Plan] = []
    if with_options and par.strategy == "auto":
        if isinstance(profile, MeasuredProfile):
            candidates = measured_options(profile, devices, train.global_batch, train.micro_batch, limit,
                                          shard_dp=par.shard_data_parallel, ac_modes=par.ac_searched(),
                                          mixed_precision=par.bf16_policy())
        else:
            candidates = plan_options(profile, devices, limit, par.max_tp, par.max_pp, device_kind=spec.resources.kind,
                                      shard_dp=par.shard_data_parallel, searched=searched,
                                      mixed_precision=par.mixed_precision)
        options = [p for p in candidates if not job_plan_refusals(p, spec)]
    return PreparedPlan(devices, model, plan, options, peak_flops(profile.device), said)


def finish_plan(spec: JobSpec, prepared: PreparedPlan, step: int,
                read_bytes_per_s: float | None) -> tuple[Plan, list[dict[str, object]] | None]:
    """The plan the workers run from `step`: a job resuming past step 0 takes the option that
    finishes first counting the move of its checkpoint (at `read_bytes_per_s`); the spec's
    memory choices applied. Also the options' comparison, where one was made. Cheap: no search."""
    plan, rows = prepared.plan, None
    if spec.parallelism.strategy == "auto" and step > 0 and len(prepared.options) > 1:
        with environment(storage_environment(spec)):
            chosen = cheapest_to_continue(spec, prepared.options, step, read_bytes_per_s)
        if chosen is not None:
            best, rows = chosen
            fastest = min(prepared.options, key=lambda p: p.estimated_step_s or float("inf"))
            if best.plan is not fastest:
                note = (f"{best.plan.describe()} chosen over the faster-stepping {fastest.describe()}: its checkpoint move is "
                        f"cheaper over the {spec.training.steps - step} remaining steps")
                best = Option(best.plan.model_copy(update={"notes": [*best.plan.notes, note]}), best.step_s, best.move_bytes)
            plan = best.plan
    plan = with_memory_choices(spec, plan).model_copy(update={"device_peak_flops": prepared.peak_flops})
    return plan, rows


@task(name="plan-parallelism")
def plan_parallelism(spec: JobSpec, model: ModelSummary, devices: int, step: int = 0,
                     read_bytes_per_s: float | None = None) -> Plan:
    """Search the parallelization for `devices` under the profiled cost model; publish it. A
    job resuming at `step` takes the plan that finishes first counting the move of its
    checkpoint (at `read_bytes_per_s`, measured by the last restore where there was one)."""
    prepared = prepare_plan(spec, model, devices, with_options=step > 0)
    plan, rows = finish_plan(spec, prepared, step, read_bytes_per_s)
    publish_plan.fn(spec, prepared, plan, step, rows)
    return plan


def plan_warnings(plan: Plan) -> list[str]:
    """What the run log says as warnings of a plan: one that does not fit its devices' memory
    (the layout closest to fitting) was said in INFO notes alone, and a run summary showed nothing."""
    if plan.feasible:
        return []
    return [f"no plan fits each device's memory less the reserve: this one needs {gib(plan.memory_per_device_bytes or 0)} "
            "per device and may run out of memory (more devices, activation checkpointing, a smaller micro_batch, or "
            "resources.memory_gb if the devices have more)"]


@task(name="publish-plan", cache_policy=NO_CACHE)
def publish_plan(spec: JobSpec, prepared: PreparedPlan, plan: Plan, step: int,
                 choice: list[dict[str, object]] | None = None) -> None:
    """Say and show the plan a segment runs: the planner's notes in the log, the plan's table
    (and the options weighed against moving the checkpoint) as artifacts."""
    logger, devices = get_run_logger(), plan.devices
    for level, line in prepared.said:
        logger.log(level, line)
    for note in plan.notes:
        logger.info(note)
    for warning in plan_warnings(plan):
        logger.warning(warning)
    if choice is not None:
        create_table_artifact(key=artifact_key(spec.job_id, f"plan-choice-{devices}"), table=choice,
                              description=f"Plans for {spec.job_id} on {counted(devices, 'device')} from step {step}: "
                              "estimated step time x remaining steps + moving the checkpoint")
    rows = [
        {"op": p.op, "stage": p.stage, "splits": " ".join(f"{d}/{'x'.join(a)}" for d, a in p.splits.items()) or "replicated",
         "compute_ms": round(p.compute_s * 1e3, 4), "comm_ms": round(p.comm_s * 1e3, 4), "memory_mb": round(p.memory_bytes / 2**20, 2)}
        for p in plan.placements
    ] or [{"mesh": str(plan.mesh), "strategy": plan.strategy, "estimated_step_s": plan.estimated_step_s}]
    create_table_artifact(
        key=artifact_key(spec.job_id, f"plan-{devices}"),
        table=rows,
        description=(
            f"Plan for {spec.job_id} on {counted(devices, spec.resources.kind + ' device')}: mesh {plan.mesh}, "
            f"estimated {plan.estimated_step_s or float('nan'):.4g} s/step; baselines "
            + ", ".join(f"{k} {v:.4g} s" for k, v in plan.baselines.items())
        ),
    )


class PlansAhead:
    """Plans for the device counts a job may move to, computed in a background thread while it
    trains (as Oobleck precomputes its pipeline templates), so that a change does not wait for
    profiling and the search: the counts the elastic policy names likely
    (`specs.elastic.likely_counts`) when a segment starts, and a count announced by an event at
    once, ahead of those. Only the step-independent part is computed ahead (`PreparedPlan`);
    `finish_plan` weighs the checkpoint's move when the change is made, so a plan taken from
    here is the plan `plan_parallelism` would have made."""

    def __init__(self, spec: JobSpec, first: ModelSummary) -> None:
        self.spec, self.first = spec, first
        self._wanted: list[int] = []
        self._done: dict[int, PreparedPlan | None] = {}
        self._busy: int | None = None
        self._lock = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._work, name="parashift-plans-ahead", daemon=True)
        self._thread.start()

    def prepare(self, counts: list[int], first: bool = False) -> None:
        """Plan these counts in the background (`first`: before the counts already waiting)."""
        with self._lock:
            new = [c for c in counts if c not in self._done and c not in self._wanted]
            self._wanted = [*new, *self._wanted] if first else [*self._wanted, *new]
            self._lock.notify()

    def take(self, devices: int, wait_s: float = 30.0) -> PreparedPlan | None:
        """The prepared plan for `devices`: waited for while it is being computed, None where it
        was not asked for or could not be made ahead (the caller plans as usual)."""
        deadline = time.monotonic() + wait_s
        with self._lock:
            if devices in self._wanted:  # asked for, not started: it goes next
                self._wanted.remove(devices)
                self._wanted.insert(0, devices)
            while devices not in self._done and (devices in self._wanted or self._busy == devices):
                if not self._lock.wait(max(0.0, deadline - time.monotonic())):
                    return None
            return self._done.get(devices)

    def close(self) -> None:
        with self._lock:
            self._closed, self._wanted = True, []
            self._lock.notify()

    def _work(self) -> None:
        # Not niced below the workers: this thread shares the flow's GIL with the thread that
        # relays their events and stops them, which a descheduled holder would keep waiting.
        while True:
            with self._lock:
                while not self._wanted and not self._closed:
                    self._lock.wait()
                if self._closed:
                    return
                self._busy = devices = self._wanted.pop(0)
            prepared = self._compute(devices)
            with self._lock:
                self._done[devices], self._busy = prepared, None
                self._lock.notify_all()

    def _compute(self, devices: int) -> PreparedPlan | None:
        said: list[str] = []
        try:  # as the flow plans a count it did not plan ahead: the count's profile, the job's spec
            model = ensure_profile(self.spec.on_devices(devices), rates_from=self.first.profile_key, say=said.append,
                                   may_measure=False)
            prepared = prepare_plan(self.spec, model, devices)
        except NeedsMeasurement:  # a launch of its own: left to the flow, in the open
            return None
        except Exception as error:  # noqa: BLE001 - planned again when needed, where the error is raised and seen
            logging.getLogger(__name__).debug("planning %d devices ahead failed: %s", devices, error)
            return None
        prepared.said[:0] = [(logging.INFO, f"planned for {counted(devices, 'device')} ahead, while the job trained"),
                             *((logging.INFO, line) for line in said)]
        return prepared
