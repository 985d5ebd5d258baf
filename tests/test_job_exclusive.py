"""One running flow per job: a second run of a job that is training fails at once, with a
message that says why, and takes nothing from the first."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from jobs import tiny_spec
from test_elastic_events import LONG, wait_for


def test_a_second_run_of_a_running_job_is_refused(prefect_server: None, tmp_path: Path, monkeypatch: Any) -> None:
    from flows.train import train_job
    from storage import JobPaths, ObjectStore
    from tasks import exclusive, progress

    monkeypatch.setenv("PARASHIFT_STOP_POLL_SECONDS", "0")
    monkeypatch.setattr(exclusive, "WAIT_S", 1.0)
    spec = tiny_spec("exclusive", f"file://{tmp_path}/store", training={**LONG, "steps": 100_000})
    started = threading.Event()

    def on_event(event: dict[str, Any]) -> None:
        if event["event"] == "step":
            started.set()

    progress.add_listener(on_event)
    first: dict[str, Any] = {}
    runner = threading.Thread(target=lambda: first.setdefault("state", train_job(spec, return_state=True)))
    runner.start()
    try:
        wait_for(started.is_set, "the first run to train", timeout_s=180)
        second = train_job(spec, return_state=True)
        assert second.is_failed()
        assert "job exclusive is already running in another flow run" in (second.message or "")
    finally:
        store = ObjectStore(spec.storage.url)
        store.put_json(JobPaths(spec.job_id).stop(), {"reason": "test over"})
        runner.join(timeout=300)
        progress.remove_listener(on_event)
    summary = first["state"].result()
    assert [s.outcome for s in summary.segments] == ["stopped"]
    # The slot is free again: the next run resumes where the first stopped.
    assert train_job(tiny_spec("exclusive", f"file://{tmp_path}/store", training={**LONG, "steps": summary.steps + 2})).steps \
        == summary.steps + 2
