"""Session-wide fixtures: an isolated Prefect home, a real local S3 endpoint (moto server mode).

Prefect reads its settings at import time, so the environment is fixed here, before any test
module imports prefect.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

_SESSION_TMP = Path(tempfile.mkdtemp(prefix="parashift-tests-"))
atexit.register(shutil.rmtree, _SESSION_TMP, ignore_errors=True)  # after the session's servers have stopped
os.environ.setdefault("PREFECT_HOME", str(_SESSION_TMP / "prefect-home"))
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "INFO")
# The session's forkservers (launcher.forkservers), shared by the xdist workers (they inherit
# this process's environment) and every process their tests start, in a folder of the session's
# own: stopped by the process that made it, at its exit, before the folder goes.
if "PARASHIFT_FORKSERVER_DIR" not in os.environ:
    os.environ["PARASHIFT_FORKSERVER_DIR"] = str(_SESSION_TMP / "forkservers")
    (_SESSION_TMP / "forkservers").mkdir(mode=0o700)

    @atexit.register
    def _stop_forkservers() -> None:
        from parashift.launcher.forkservers import stop_all

        stop_all(_SESSION_TMP / "forkservers")
# Several worker processes on 2 cores: one thread each (measured: 2 x 2 threads ran 2.3x slower than 2 x 1).
os.environ.setdefault("OMP_NUM_THREADS", "1")

REPO_ROOT = Path(__file__).resolve().parents[1]

# `make test` runs the suite on three pytest-xdist workers, a file at a time (`--dist loadfile`:
# a file's module fixtures, such as test_nodes' two Prefect workers, start once). Files start in
# collection order (`--no-loadscope-reorder`: else xdist 3.8 orders them by their count of tests,
# and the longest ones started last), so the longest ones by `--durations` are collected first:
# otherwise one starts last and the other workers idle while it runs.
RUN_FIRST = ("test_flow.py", "test_elastic_events.py", "test_nodes.py", "test_pool_live.py", "test_job_exclusive.py",
             "test_serve.py", "test_planner_outer.py", "test_parallel_plans.py", "test_gpu_check.py",
             "test_recompute.py", "test_hf_family.py", "test_train_resume.py", "test_llama.py",
             "test_git_submission.py", "test_planner_plan.py", "test_deployments.py", "test_worker_resources.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest files first (RUN_FIRST), the rest in their usual order."""
    rank = {name: i for i, name in enumerate(RUN_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(RUN_FIRST)))


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """A real S3-protocol server (moto, server mode) on 127.0.0.1 at a free port."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")}
    os.environ["AWS_ACCESS_KEY_ID"] = "testing"
    os.environ["AWS_SECRET_ACCESS_KEY"] = "testing"
    os.environ["AWS_DEFAULT_REGION"] = "us-east-1"
    try:
        yield endpoint
    finally:
        server.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture
def s3_bucket(s3_endpoint: str) -> str:
    """A fresh, empty bucket on the local S3 endpoint; returns its name."""
    import boto3

    name = f"parashift-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1").create_bucket(Bucket=name)
    return name


# A Prefect database migrated once per test run. A server (or `parashift run`'s embedded API)
# on a fresh database spends ~7 s of CPU creating and migrating it (measured: 10.4 s of CPU to
# answer on a fresh database, 3.4-4.7 s on one already made); the suite starts about ten. The
# session's server migrates its own, and the first one up leaves a copy of it, made before any
# test has used it, for the others (`prefect_home`): each copy is a database of its own, as a
# user's second start finds it. The README's run keeps its truly fresh start (tests/test_flow.py).
PREFECT_DB = "prefect.db"


def _database_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the migrated database's copy lies: one per run, shared by its xdist workers."""
    base = tmp_path_factory.getbasetemp()
    return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "prefect-template" / PREFECT_DB


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """One real Prefect API server for the whole session (temporary SQLite database)."""
    import fcntl
    import sqlite3

    from prefect.settings import PREFECT_SERVER_DATABASE_CONNECTION_URL
    from prefect.testing.utilities import prefect_test_harness

    copy = _database_copy(tmp_path_factory)
    copy.parent.mkdir(exist_ok=True)
    with prefect_test_harness(server_startup_timeout=180):
        with open(copy.parent / "lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not copy.exists():
                ours = PREFECT_SERVER_DATABASE_CONNECTION_URL.value().split(":///", 1)[1]
                with sqlite3.connect(ours) as source, sqlite3.connect(copy.with_suffix(".tmp")) as target:
                    source.backup(target)  # consistent while the server runs
                copy.with_suffix(".tmp").rename(copy)
        yield


@pytest.fixture(scope="session")
def prefect_home(prefect_server: None, tmp_path_factory: pytest.TempPathFactory) -> Callable[[Path], Path]:
    """`prefect_home(folder)`: a PREFECT_HOME whose server starts on a copy of the migrated database."""
    copy = _database_copy(tmp_path_factory)

    def seeded(folder: Path) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(copy, folder / PREFECT_DB)
        return folder

    return seeded
