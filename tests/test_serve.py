"""`parashift serve` (what `make serve` runs): a server, the pool, every deployment and a worker
from one command; Ctrl-C leaves none of its processes behind."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from jobs import descendants

pytestmark = pytest.mark.slow


def test_serve_deploys_everything_and_stops_cleanly(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env["PREFECT_HOME"] = str(tmp_path / "home")
    parashift = str(Path(sys.executable).with_name("parashift"))
    serve = subprocess.Popen([parashift, "serve", "--port", "0"], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        assert serve.stdout is not None
        deadline, lines = time.monotonic() + 240, []
        while not any(line.startswith("PREFECT_API_URL=") for line in lines):
            assert time.monotonic() < deadline and serve.poll() is None, "".join(lines)
            lines.append(serve.stdout.readline())
        api = next(line for line in lines if line.startswith("PREFECT_API_URL=")).split("=", 1)[1].strip()
        assert any(re.match(r"Prefect UI: http://127\.0\.0\.1:\d+$", line.strip()) for line in lines)
        request = urllib.request.Request(f"{api}/deployments/filter", data=b"{}", headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            names = {d["name"] for d in json.load(response)}
        assert {"train-job", "train-spec-file"} <= names
        started = descendants(serve.pid)
        assert started, "the server and the worker run below the command"
    finally:
        serve.send_signal(signal.SIGINT)
        output, _ = serve.communicate(timeout=120)
    assert serve.returncode == 0, output[-2000:]
    assert "stopped the worker and the server" in output
    time.sleep(1)
    assert not [pid for pid in started if Path(f"/proc/{pid}").exists()], "serve left processes behind"
