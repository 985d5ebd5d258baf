"""prefect.yaml as a user runs it: deploy to a real server, then a process worker runs a
committed spec file by path."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_metrics_board import scalars

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]


def prefect_cli(*args: str, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    prefect = Path(sys.executable).with_name("prefect")
    done = subprocess.run([str(prefect), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"prefect {' '.join(args)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def test_deploy_and_run_a_spec_file_with_a_process_worker(prefect_server: None, tmp_path: Path) -> None:
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL

    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PREFECT_HOME": str(tmp_path / "home")}
    for pool in ("parashift", "parashift-nodes"):
        prefect_cli("work-pool", "create", pool, "--type", "process", "--overwrite", env=env)
    prefect_cli("--no-prompt", "deploy", "--all", env=env)

    spec = tmp_path / "job.yaml"
    spec.write_text(
        "name: from-git\n"
        "model: {n_layers: 1, d_model: 32, n_heads: 2, seq_len: 32}\n"
        "data: {max_bytes: 100000}\n"
        "training: {global_batch: 4, micro_batch: 2, steps: 3, checkpoint_every: 3}\n"
        f"storage: {{url: 'file://{tmp_path}/store'}}\n"
    )

    async def deployments():
        async with get_client() as client:
            return {d.name: d for d in await client.read_deployments()}

    found = asyncio.run(deployments())
    assert {"train-job", "train-spec-file", "submit-from-git", "parashift-node"} <= set(found)
    assert not found["train-job"].schedules, "re-running a finished job on a timer would train nothing"
    schedules = found["submit-from-git"].schedules
    assert schedules and not any(s.active for s in schedules), "the git poll ships inactive until a repository is set"

    run = prefect_cli("deployment", "run", "train-spec-file/train-spec-file", "-p", f"path={spec}", env=env)
    assert "Created flow run" in run.stdout
    prefect_cli("worker", "start", "--pool", "parashift", "--run-once", env=env, timeout=400)
    assert (tmp_path / "store/jobs/from-git/ckpt/00000003/manifest.json").exists()
    # a deployed run writes the same metrics as `parashift run`: TensorBoard files in the job's storage
    board = scalars(tmp_path / "store/jobs/from-git/metrics")
    assert [step for step, _ in board["loss"]] == [1, 2, 3]
    assert all(0 < mfu <= 1 for _, mfu in board["mfu"])
