"""A real `prefect server` for a benchmark: started in a temporary home on 127.0.0.1, this
process pointed at it (client settings in the environment), stopped at the end."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from parashift.commands.serve import start_prefect_server, stop_group


@contextlib.contextmanager
def bench_prefect_server(tmp: Path) -> Iterator[str]:
    """The server's API URL, with PREFECT_API_URL and a client home of its own set here."""
    env = {**os.environ, "PREFECT_HOME": str(tmp / "server-home"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    server, url = start_prefect_server(env)
    try:
        os.environ.update({"PREFECT_API_URL": url, "PREFECT_HOME": str(tmp / "client-home"),
                           "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                           "PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL": os.environ.get("BENCH_LOG_LEVEL", "WARNING")})
        yield url
    finally:
        stop_group(server)
