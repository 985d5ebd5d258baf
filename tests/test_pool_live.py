"""A pool live on this machine: a real Prefect server, train-job deployed to a process worker,
the pool's controller as `parashift pool` (a process of its own). Two jobs of different
families share 2 CPU devices; the first, alone on both, shrinks to one when the second (of
higher priority) arrives, and the second waits for the slot it frees. A third job, of the
highest priority and submitted with the first, is given a device and fails for good (its
run's preflight finds no corpus): the device goes to the first job.
The controller is killed with -9 in the middle and started again: it goes on from the pool's
state in storage. Each job trains every step once, with the losses of its own static run, and
every sample once (the workers' sample log)."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from jobs import LOSS_RTOL, assert_each_sample_once, run
from parashift.pool.state import read_state
from parashift.specs import JobSpec
from parashift.specs.plan import Plan
from parashift.specs.pool import PoolSpec
from parashift.storage import open_store
from test_elastic_events import wait_for
from test_metrics_board import scalars

from parashift.commands.serve import REPO, deploy_all, start_worker, stop_group

pytestmark = pytest.mark.slow


def pool_job(name: str, store: str, model: dict[str, Any], steps: int, data: dict[str, Any] | None = None,
             **resources: Any) -> JobSpec:
    return JobSpec.model_validate({
        "name": name, "model": model, "data": {"max_bytes": 400_000, **(data or {})},
        "optimizer": {"lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 2},
        "training": {"global_batch": 12, "micro_batch": 2, "steps": steps, "seed": 3, "checkpoint_every": 10},
        "resources": {"devices": 1, "warm_workers": True, **resources}, "storage": {"url": store}})


def cli(*args: str, env: dict[str, str], log: Path | None = None) -> subprocess.Popen[bytes]:
    out = open(log, "ab") if log is not None else subprocess.DEVNULL  # noqa: SIM115 - the process owns it
    return subprocess.Popen([sys.executable, "-m", "parashift.cli", *args], cwd=REPO, env=env, stdout=out,
                            stderr=subprocess.STDOUT, start_new_session=True)


def test_a_pool_shares_devices_exactly_and_survives_its_controller_killed(prefect_server: None, tmp_path: Path) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.settings import PREFECT_API_URL

    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PREFECT_HOME": str(tmp_path / "home"),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "OMP_NUM_THREADS": "1",
           "PARASHIFT_SAMPLE_LOG": str(tmp_path / "samples")}  # what every worker of both jobs trains on
    deploy_all(env, only="train-job")  # what the pool starts its jobs as
    store = f"file://{tmp_path}/store"
    pool = PoolSpec(name="live", devices=2, storage={"url": store}, tick_s=0.5)  # type: ignore[arg-type]
    (tmp_path / "pool.yaml").write_text(f"name: live\ndevices: 2\nstorage: {{url: '{store}'}}\ntick_s: 0.5\n")
    long = pool_job("long-gpt", store, {"n_layers": 6, "d_model": 256, "n_heads": 4, "vocab_size": 256,
                                        "seq_len": 96}, steps=30)
    short = pool_job("short-llama", store, {"family": "llama", "n_layers": 2, "d_model": 96, "n_heads": 4,
                                            "n_kv_heads": 2, "vocab_size": 256, "seq_len": 96}, steps=16, priority=1)
    broken = pool_job("broken-data", store, {"n_layers": 1, "d_model": 64, "n_heads": 2, "vocab_size": 256,
                                             "seq_len": 32}, steps=20, data={"url": f"file://{tmp_path}/no-corpus.txt"},
                      priority=2)
    for spec in (long, short, broken):
        (tmp_path / f"{spec.name}.yaml").write_text(spec.model_dump_json())  # JSON is YAML

    def static_losses() -> dict[str, dict[int, float]]:
        """Each job's losses on its own, unchanged: the reference (on this process's warm
        workers, while the pool runs: the trace mostly waits on process startups)."""
        out = {}
        for spec in (long, short):
            static = run(spec.model_copy(update={"storage": spec.storage.model_copy(
                update={"url": f"file://{tmp_path}/static-{spec.name}"})}), Plan.data_parallel(1))
            out[spec.name] = {e.step: e.loss for e in static.steps}
        return out

    reference = concurrent.futures.ThreadPoolExecutor(1).submit(static_losses)
    worker = start_worker("parashift", env, tmp_path / "worker.log")
    controllers: list[subprocess.Popen[bytes]] = []
    state_store = open_store(pool.storage)

    def state() -> Any:
        return read_state(state_store, "live", 2)

    try:
        for first in ("broken-data", "long-gpt"):  # the broken job ranks first, so it takes a device
            assert cli("submit", str(tmp_path / f"{first}.yaml"), "--pool", str(tmp_path / "pool.yaml"),
                       env=env).wait() == 0
        controllers.append(cli("pool", str(tmp_path / "pool.yaml"), "--until-idle", env=env, log=tmp_path / "ctl.log"))
        wait_for(lambda: state().jobs.get("long-gpt") and state().jobs["long-gpt"].measured_step_s,
                 "the first job to step", 240)
        wait_for(lambda: state().jobs["broken-data"].status == "failed", "the broken job to fail for good", 120)
        # the first job takes the freed device and steps on both before the second arrives
        wait_for(lambda: 2 in state().jobs["long-gpt"].measured_step_s, "the first job to step on 2 devices", 120)
        assert cli("submit", str(tmp_path / "short-llama.yaml"), "--pool", str(tmp_path / "pool.yaml"), env=env).wait() == 0
        wait_for(lambda: (job := state().jobs.get("short-llama")) and job.flow_run_id, "the second job to start", 120)
        os.killpg(controllers[-1].pid, signal.SIGKILL)  # mid-trace: its runs go on without it
        controllers[-1].wait()
        controllers.append(cli("pool", str(tmp_path / "pool.yaml"), "--until-idle", env=env, log=tmp_path / "ctl.log"))
        assert controllers[-1].wait(timeout=400) == 0, (tmp_path / "ctl.log").read_text()[-5000:]
    finally:
        for process in [*controllers, worker]:
            stop_group(process)
    final = state()
    assert {job.job_id: job.status for job in final.jobs.values()} == {
        "long-gpt": "finished", "short-llama": "finished", "broken-data": "failed"}
    assert "data" in (final.jobs["broken-data"].reason or ""), final.jobs["broken-data"].reason
    # It held a device, and once it failed for good the first job had both.
    held = [i for i, d in enumerate(final.decisions) if d.devices.get("broken-data")]
    freed = next(i for i, d in enumerate(final.decisions) if "broken-data failed" in d.event)
    assert held and held[0] < freed, [(d.event, d.devices) for d in final.decisions]
    assert final.decisions[freed].devices.get("long-gpt") == 2, final.decisions[freed]
    assert any(d.event.startswith("short-llama submitted") for d in final.decisions)
    assert all(sum(d.devices.values()) <= 2 for d in final.decisions)
    with get_client(sync_client=True) as client:
        limit = client.read_global_concurrency_limit_by_name("parashift-pool-live")
        shown = {a.key: a for a in client.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=["pool-live-decision", "pool-live-allocations"])))}
    assert limit.limit == 2 and limit.active_slots == 0
    assert set(shown) == {"pool-live-decision", "pool-live-allocations"}  # every decision, and the chart
    assert "data:image/png;base64," in shown["pool-live-allocations"].data

    for spec in (long, short):
        found = scalars(Path(f"{tmp_path}/store/jobs/{spec.name}/metrics"))
        steps = [step for step, _ in found["loss"]]
        assert sorted(steps) == list(range(1, spec.training.steps + 1)), f"{spec.name}: every step once"
        # every sample once, across the pool's changes to the job (its launches, from the log)
        assert_each_sample_once(tmp_path / "samples", None, spec.training.steps, (400_000 - 1) // spec.model.seq_len,
                                spec.training.global_batch, job=spec.name)
        want = reference.result(timeout=300)[spec.name]
        for step, got in found["loss"]:
            assert abs(got - want[step]) <= LOSS_RTOL * abs(want[step]) + 1e-6, (spec.name, step, got, want[step])
    assert len({int(n) for _, n in scalars(Path(f"{tmp_path}/store/jobs/long-gpt/metrics"))["devices"]}) >= 2, \
        "the first job changed its device count when the second arrived"
