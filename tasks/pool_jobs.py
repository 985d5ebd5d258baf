"""What a pool knows of a job before it runs: its predicted seconds per step at each device count
(pool/step_times.py blends them with what the job measures), the planner's pick for each count
under the cost model of the job's device kind (on CPU, each of n workers with its share of this
machine's cores), the search `tasks/plan.py` runs, without timing anything on workers; and the
training state its changes move (`pool.change_cost`)."""

from __future__ import annotations

from parashift.pool.change_cost import state_bytes
from parashift.pool.step_times import Prediction
from parashift.specs import JobSpec


def predicted(spec: JobSpec, counts: list[int]) -> Prediction:
    """The planner's step time for each count (a count it finds no plan for is left out), and
    the job's training state."""
    from parashift.planner.measured import MeasuredProfile, plan_measured
    from parashift.planner.profile import share_cores
    from parashift.planner.search import plan_model
    from parashift.tasks.profile import build_profile

    base = build_profile(spec.on_devices(1))  # one worker: nothing to time on others
    par, train = spec.parallelism, spec.training
    out: dict[int, float] = {}
    for n in counts:
        profile = base.model_copy(update={"device": share_cores(base.device, n)})
        limit = par.plan_memory_bytes(profile.device.memory_bytes)
        try:
            if isinstance(profile, MeasuredProfile):
                plan = plan_measured(profile, n, train.global_batch, train.micro_batch, limit,
                                     shard_dp=par.shard_data_parallel, ac_modes=par.ac_searched(),
                                     mixed_precision=par.bf16_policy())
            else:
                plan = plan_model(profile, n, limit, par.max_tp, par.max_pp, device_kind=spec.resources.kind,
                                  shard_dp=par.shard_data_parallel, ac_modes=par.ac_searched(),
                                  mixed_precision=par.mixed_precision)
        except ValueError:  # no plan fits this count
            continue
        if plan.estimated_step_s:
            out[n] = float(plan.estimated_step_s)
    return Prediction(out, state_bytes(base.n_params))
