"""`parashift serve`: a local Prefect server, the `parashift` process work pool, every
deployment in prefect.yaml and a worker, in one command; Ctrl-C stops all of them."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import typer

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_prefect_server(env: dict[str, str], port: int | None = None, timeout_s: float = 180) -> tuple[subprocess.Popen[bytes], str]:
    """`prefect server start` on 127.0.0.1 (its own session, so it can be stopped as a group);
    returns the process and its API URL once `/health` answers."""
    port = port or free_port()
    url = f"http://127.0.0.1:{port}/api"
    # The UI's pages call the API at PREFECT_UI_API_URL, which otherwise defaults to port 4200.
    env = {**{k: v for k, v in env.items() if k != "PREFECT_API_URL"}, "PREFECT_UI_API_URL": url}
    server = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"prefect server exited with code {server.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return server, url
        except OSError:
            time.sleep(0.5)
    stop_group(server)
    raise RuntimeError(f"prefect server did not answer on {url} within {timeout_s:.0f} s")


def stop_group(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM the process group this command started, SIGKILL it if it lingers."""
    if process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    except ProcessLookupError:
        pass


def _prefect(*args: str, env: dict[str, str]) -> None:
    done = subprocess.run([sys.executable, "-m", "prefect", *args], cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"prefect {' '.join(args)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")


def serve(
    port: int = typer.Option(4200, help="the server's port on 127.0.0.1 (0: any free one)"),
    pool: str = typer.Option("parashift", help="the process work pool prefect.yaml deploys to"),
) -> None:
    """Start a local Prefect server, create the work pool, deploy prefect.yaml, print the UI URL,
    and run a worker in the foreground until Ctrl-C (which stops the worker and the server)."""
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    server, api = start_prefect_server(env, port or None)
    worker = None
    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        env["PREFECT_API_URL"] = api
        _prefect("work-pool", "create", pool, "--type", "process", "--overwrite", env=env)
        _prefect("--no-prompt", "deploy", "--all", env=env)
        ui = api.removesuffix("/api")
        typer.echo(f"Prefect UI: {ui}\nPREFECT_API_URL={api}\n"
                   f"deployments from {REPO / 'prefect.yaml'} on work pool '{pool}'; a worker runs them until Ctrl-C")
        worker = subprocess.Popen([sys.executable, "-m", "prefect", "worker", "start", "--pool", pool], cwd=REPO, env=env,
                                  start_new_session=True)
        while not stopping and worker.poll() is None:
            time.sleep(0.2)
    finally:
        if worker is not None:
            stop_group(worker)
        stop_group(server)
        typer.echo("stopped the worker and the server")
