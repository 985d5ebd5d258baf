"""Specs that are well formed but cannot run: refused before any worker starts, in seconds,
with one line naming the field and what to do; and which failures a task retry may fix."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from jobs import tiny_spec
from parashift.storage import StorageError, StoragePermissionError, TransientStorageError
from parashift.tasks.preflight import (
    PreflightFailed,
    Problem,
    check_data,
    check_devices,
    check_storage,
    preflight,
)
from parashift.tasks.retry import may_fix


def spec_with(tmp_path: Path, **sections: dict[str, Any]):
    sections.setdefault("storage", {"url": f"file://{tmp_path}/store"})
    return tiny_spec("pre", sections["storage"]["url"], **sections)


def one(problems: list[Problem], field: str, *words: str) -> None:
    assert len(problems) == 1, problems
    text = str(problems[0])
    assert problems[0].field == field and "\n" not in text, text
    for word in words:
        assert word in text, text


def test_a_job_that_can_run_passes(tmp_path: Path) -> None:
    started = time.monotonic()
    assert preflight(spec_with(tmp_path)) == []
    assert time.monotonic() - started < 10
    assert not list((tmp_path / "store/jobs/pre").iterdir()), "the probe object is deleted"


def test_storage_only_one_process_can_see(tmp_path: Path) -> None:
    one(check_storage(spec_with(tmp_path, storage={"url": "memory://jobs"})), "storage.url", "memory://", "file://")


def test_storage_backend_not_installed(tmp_path: Path) -> None:
    try:
        import gcsfs  # noqa: F401
    except ImportError:
        one(check_storage(spec_with(tmp_path, storage={"url": "gs://bucket/x"})), "storage.url", "gs://", "gcsfs")
    else:
        pytest.skip("gcsfs is installed here")


def test_storage_that_cannot_be_created(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    one(check_storage(spec_with(tmp_path, storage={"url": f"file://{blocker}/store"})), "storage.url", str(blocker))


def test_s3_bucket_missing_credentials_missing_and_endpoint_unreachable(
    tmp_path: Path, s3_endpoint: str, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def s3(url: str, endpoint: str) -> Any:
        return spec_with(tmp_path, storage={"url": url, "storage_options": {"endpoint_url": endpoint}})

    assert check_storage(s3(f"s3://{s3_bucket}/x", s3_endpoint)) == []
    one(check_storage(s3("s3://no-such-bucket/x", s3_endpoint)), "storage.url", "no-such-bucket", "not found")
    started = time.monotonic()
    one(check_storage(s3(f"s3://{s3_bucket}/x", "http://127.0.0.1:9"), timeout_s=15), "storage.url", "127.0.0.1:9")
    assert time.monotonic() - started < 20
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(key)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    one(check_storage(s3(f"s3://{s3_bucket}/x", s3_endpoint)), "storage.url", f"s3://{s3_bucket}/x: no credentials found")


def test_local_tier_that_is_not_a_folder(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    spec = spec_with(tmp_path, storage={"url": f"file://{tmp_path}/store", "local_tier": str(blocker)})
    one(check_storage(spec), "storage.local_tier", str(blocker))


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("{tmp}/missing.txt", ["missing.txt", "cannot be read"]),
        ("{tmp}/none-*.txt", ["matches no files"]),
        ("{tmp}/short.txt", ["holds 5 bytes", "needs 33", "seq_len"]),
        ("{tmp}/empty.txt", ["holds 0 bytes"]),
        ("memory://corpus.txt", ["memory://"]),
        ("http://127.0.0.1:9/corpus.txt", ["127.0.0.1:9", "cannot be read"]),
    ],
)
def test_data_that_cannot_feed_one_sample(tmp_path: Path, url: str, words: list[str]) -> None:
    (tmp_path / "short.txt").write_text("short")
    (tmp_path / "empty.txt").write_text("")
    spec = spec_with(tmp_path, data={"url": url.format(tmp=tmp_path), "max_bytes": None})
    one(check_data(spec, timeout_s=15), "data.url", *words)


def test_max_bytes_below_one_sample_is_named(tmp_path: Path) -> None:
    spec = spec_with(tmp_path, data={"max_bytes": 10})
    one(check_data(spec), "data.url", "data.max_bytes 10", "needs 33")


def test_model_too_big_for_the_devices(tmp_path: Path) -> None:
    big = {"n_layers": 96, "d_model": 12288, "n_heads": 96, "vocab_size": 50257, "seq_len": 32, "dropout": 0.0}
    one(check_devices(spec_with(tmp_path, model=big)), "model", "needs at least", "GiB per device",
        "parallelism.strategy: auto")
    small_gpu = spec_with(tmp_path, resources={"devices": 2, "kind": "cpu", "memory_gb": 0.0001})
    one(check_devices(small_gpu), "model", "resources.memory_gb 0.0001")
    # What the planner may fill, as it reads memory_gb (GiB, less its reserve): 0.05 GiB held the
    # tiny model's state (passed here) and the 1 GiB reserve left the planner nothing: a plan over
    # its limit ran. Without the reserve it fits.
    reserved = spec_with(tmp_path, resources={"devices": 2, "kind": "cpu", "memory_gb": 0.05})
    one(check_devices(reserved), "model", "less the planner's reserve gives 0 GiB", "parallelism.memory_reserve_gb")
    assert check_devices(spec_with(tmp_path, resources={"devices": 2, "kind": "cpu", "memory_gb": 0.05},
                                   parallelism={"memory_reserve": 0, "memory_reserve_gb": 0})) == []


def test_more_cpu_workers_than_the_machine_holds(tmp_path: Path) -> None:
    spec = spec_with(tmp_path, resources={"devices": 65536, "kind": "cpu"},
                     training={"global_batch": 65536, "micro_batch": 1})
    one(check_devices(spec), "resources.devices", "65,536 CPU worker processes", "use at most")


def test_cuda_where_there_is_none(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    one(check_devices(spec_with(tmp_path, resources={"devices": 1, "kind": "cuda"})), "resources.kind", "no CUDA device")


def test_a_job_across_nodes_needs_a_server_and_not_this_machine_s_devices(tmp_path: Path) -> None:
    """Its launchers run through a Prefect server's node workers: without one it is refused
    here (it waited 180 s for launchers, then said every node left). Its devices are the
    nodes' own: GPUs the machine its flow runs on lacks are not a problem."""
    from parashift.tasks.preflight import check_nodes
    from prefect.settings import PREFECT_API_URL, temporary_settings

    spec = spec_with(tmp_path, resources={"nodes": ["a", "b"], "devices_per_node": 1, "kind": "cuda"})
    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        one(check_nodes(spec), "resources.nodes", "PREFECT_API_URL", "parashift serve --nodes")
    with temporary_settings({PREFECT_API_URL: "http://127.0.0.1:9/api"}):
        assert check_nodes(spec) == []
    assert check_devices(spec) == []  # no CUDA here, and none needed here
    small = spec_with(tmp_path, resources={"nodes": ["a", "b"], "devices_per_node": 1, "memory_gb": 0.0001})
    one(check_devices(small), "model", "resources.memory_gb 0.0001")  # a bound it states still holds


def test_validate_check_and_run_refuse_in_seconds_with_one_line_each(tmp_path: Path) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text("name: pre\nmodel: {n_layers: 1, d_model: 32, n_heads: 2, seq_len: 32}\n"
                    f"data: {{url: '{tmp_path}/nothing-*.txt'}}\nstorage: {{url: 'memory://x'}}\n")
    parashift = str(Path(sys.executable).with_name("parashift"))
    for command in (["validate", "--check"], ["run"]):
        started = time.monotonic()
        done = subprocess.run([parashift, *command, str(spec)], capture_output=True, text=True, timeout=120)
        lines = (done.stdout + done.stderr).strip().splitlines()
        assert done.returncode == 1 and time.monotonic() - started < 30, lines
        assert lines == [f"{spec}: data.url: {tmp_path}/nothing-*.txt matches no files",
                         f"{spec}: storage.url: memory:// lives inside one process, and the flow and every worker "
                         "are separate processes: use file:// (one machine) or s3://"], lines


def test_a_second_run_of_a_running_job_is_refused_before_prefect_starts(tmp_path: Path) -> None:
    """Another run holds the job's storage lease: `parashift run` says so in one line, in
    seconds, before its Prefect API answers (the one it began booting is killed unused), before
    workers or a log (the flow's own lease still decides where two runs start at once:
    tests/test_job_exclusive.py)."""
    from parashift.storage import ObjectStore
    from parashift.storage.lease import JobLease

    spec = tmp_path / "job.yaml"
    spec.write_text("name: held\nmodel: {n_layers: 1, d_model: 32, n_heads: 2, seq_len: 32}\n"
                    f"data: {{max_bytes: 100000}}\nstorage: {{url: 'file://{tmp_path}/store'}}\n")
    lease = JobLease(ObjectStore(f"file://{tmp_path}/store"), "held", ttl_s=600)
    lease.acquire()
    try:
        started = time.monotonic()
        done = subprocess.run([str(Path(sys.executable).with_name("parashift")), "run", str(spec)], cwd=tmp_path,
                              capture_output=True, text=True, timeout=120)
    finally:
        lease.release()
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert done.returncode == 1 and time.monotonic() - started < 30, lines
    assert len(lines) == 1 and lines[0].startswith(f"{spec}: job held is already running: "), lines
    assert f"holds its storage lease file://{tmp_path}/store/jobs/held/lease.json" in lines[0], lines
    assert not (tmp_path / ".parashift").exists()  # no run log: nothing was started


def test_preflight_failed_says_it_all_in_one_line() -> None:
    error = PreflightFailed("job", [Problem("a.b", "first"), Problem("c", "second")])
    assert str(error) == "job cannot run: a.b: first; c: second"


def test_only_failures_of_the_moment_are_retried() -> None:
    assert may_fix(TransientStorageError("slow down")) and may_fix(ConnectionResetError()) and may_fix(RuntimeError("port"))
    for error in (StoragePermissionError("denied"), StorageError("no such bucket"), FileNotFoundError("data"),
                  ValueError("bad spec"), PreflightFailed("job", [Problem("x", "y")]), ImportError("gcsfs")):
        assert not may_fix(error), error
