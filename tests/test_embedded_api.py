"""`parashift run`'s embedded Prefect API (parashift/commands/embedded_api.py): started only where
no Prefect settings source names an API; once used, every thread's client talks to it, the run
hears no resource events from it, and it is gone when the process ends."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = """
import json, threading
from parashift.commands.embedded_api import start_unless_configured
api = start_unless_configured()
if api is None:
    print(json.dumps({"started": False}))
else:
    from prefect import get_client
    from prefect.settings import PREFECT_API_URL
    from parashift.tasks.events import api_url
    url = api.use()
    seen = []
    thread = threading.Thread(target=lambda: seen.append(PREFECT_API_URL.value()))  # as Prefect's log worker
    thread.start(); thread.join()
    with get_client(sync_client=True) as client:
        healthy = client.api_healthcheck() is None
    print(json.dumps({"started": True, "pid": api.process.pid, "url": url, "thread_sees": seen[0],
                      "healthy": healthy, "events_api": api_url()}))
"""


def run_script(home: Path, **settings: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env.update(PREFECT_HOME=str(home), **settings)
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def test_an_api_named_in_a_prefect_profile_is_used_and_nothing_starts(tmp_path: Path) -> None:
    (tmp_path / "profiles.toml").write_text(
        'active = "mine"\n[profiles.mine]\nPREFECT_API_URL = "http://127.0.0.1:9/api"\n')
    assert run_script(tmp_path) == {"started": False}
    # nor where the user turned Prefect's ephemeral API off (Prefect's own error follows)
    assert run_script(tmp_path / "off", PREFECT_SERVER_EPHEMERAL_ENABLED="false") == {"started": False}


def test_the_embedded_api_serves_every_thread_and_ends_with_the_process(tmp_path: Path,
                                                                      prefect_home) -> None:  # noqa: ANN001
    found = run_script(prefect_home(tmp_path / "home"))
    assert found["started"] and found["healthy"], found
    assert found["thread_sees"] == found["url"]  # a thread of its own falls back to the same settings
    assert found["events_api"] is None  # no other process can reach it: no resource events are awaited
    assert not _alive(found["pid"])  # stopped at the process's exit
