"""`parashift serve`: a local Prefect server, the `parashift` process work pools, every
deployment in prefect.yaml and a worker (and, with `--nodes`, a node worker per named node on
this machine), in one command; Ctrl-C stops all of them."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import IO

import typer

from parashift.specs import environ

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# How often a server is started on a new port when the one chosen for it was taken before it
# bound it (another process of the machine chose the same free port meanwhile).
PORT_TRIES = 5


def start_prefect_server(env: dict[str, str], port: int | None = None, timeout_s: float = 180) -> tuple[subprocess.Popen[bytes], str]:
    """`prefect server start` on 127.0.0.1 (its own session, so it can be stopped as a group);
    returns the process and its API URL once `/health` answers. A server that exits first is
    reported with what it said (e.g. "Port 4200 is already in use"); where the port was chosen
    here, one taken before the server bound it is chosen again."""
    tries = 1 if port else PORT_TRIES
    for attempt in range(tries):
        chosen = port or free_port()
        url = f"http://127.0.0.1:{chosen}/api"
        # The UI's pages call the API at PREFECT_UI_API_URL, which otherwise defaults to port 4200.
        server_env = {**{k: v for k, v in env.items() if k != "PREFECT_API_URL"}, "PREFECT_UI_API_URL": url}
        # What it says goes to a file of its own (a pipe nobody reads would fill and stop it):
        # unlinked, it lasts as long as the server; read only if the server exits first.
        with tempfile.TemporaryFile() as output:
            # Prefect's own `server start`, its app replaying writes SQLite refused (commands/prefect_app.py).
            server = subprocess.Popen([sys.executable, "-m", "parashift.commands.prefect_app", "server", "start",
                                       "--host", "127.0.0.1", "--port", str(chosen)],
                                      env=server_env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                wait_healthy(server, url, timeout_s, what="prefect server")
                return server, url
            except RuntimeError as error:
                stop_group(server)
                said = _last_lines(output)
                if attempt + 1 < tries and "already in use" in said:
                    continue
                raise RuntimeError(f"{error}: {said}" if said else str(error)) from None
    raise AssertionError("unreachable: the last try returns or raises")


def _last_lines(output: IO[bytes], count: int = 5) -> str:
    output.seek(0)
    return " ".join(line.strip() for line in output.read().decode(errors="replace").splitlines()[-count:]
                    if line.strip())


def wait_healthy(process: subprocess.Popen[bytes], url: str, timeout_s: float, what: str) -> None:
    """Return once the API at `url` answers `/health`; RuntimeError if `process` (its server)
    exits first or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with code {process.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{what} did not answer on {url} within {timeout_s:.0f} s")


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


# The pool of prefect.yaml's per-node launcher; each node's worker serves the queue of its name.
NODE_POOL = "parashift-nodes"


def deploy_all(env: dict[str, str], pool: str = "parashift", only: str | None = None) -> None:
    """The process work pools prefect.yaml names, and every deployment in it (`only`: that one)."""
    for name in (pool, NODE_POOL):
        _prefect("work-pool", "create", name, "--type", "process", "--overwrite", env=env)
    _prefect("--no-prompt", "deploy", *(["--name", only] if only else ["--all"]), env=env)


# How often a worker asks the server for runs to start. Prefect's default, 10 s, is how long a
# run submitted from the UI or by the pool's controller may sit scheduled before it starts; on
# the local server `parashift serve` runs, a query every 2 s costs nothing worth 8 s of wait.
WORKER_QUERY_S = "2"


def start_worker(pool: str, env: dict[str, str], log: Path | None = None, *options: str,
                 quiet: bool = False) -> subprocess.Popen[bytes]:
    """A Prefect worker of `pool` (its own session; stop it with `stop_group`), asking for runs
    every WORKER_QUERY_S unless the environment says otherwise. Its output goes to `log`, else
    nowhere (`quiet`), else to this process's terminal."""
    out = open(log, "ab") if log is not None else subprocess.DEVNULL if quiet else None  # noqa: SIM115 - the process owns it
    env = {"PREFECT_WORKER_QUERY_SECONDS": WORKER_QUERY_S, **env}
    return subprocess.Popen([sys.executable, "-m", "prefect", "worker", "start", "--pool", pool, *options], cwd=REPO,
                            env=env, stdout=out, stderr=subprocess.STDOUT if out is not None else None,
                            start_new_session=True)


def start_node_worker(node: str, env: dict[str, str], log: Path | None = None) -> subprocess.Popen[bytes]:
    """What a node runs to take part in jobs across nodes: a Prefect worker of the node pool on
    the work queue named after the node."""
    return start_worker(NODE_POOL, env, log, "--work-queue", node, "--name", f"node-{node}", quiet=True)


def serve(
    port: int = typer.Option(4200, help="the server's port on 127.0.0.1 (0: any free one)"),
    pool: str = typer.Option("parashift", help="the process work pool prefect.yaml deploys to"),
    nodes: str = typer.Option("", help="comma-separated node names: run a node worker for each on this machine "
                                       "(jobs with resources.nodes; real nodes run `prefect worker start --pool "
                                       f"{NODE_POOL} --work-queue NODE` themselves)"),
) -> None:
    """Start a local Prefect server, create the work pools, deploy prefect.yaml, print the UI URL,
    and run a worker in the foreground until Ctrl-C (which stops the workers and the server)."""
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    server, api = start_prefect_server(env, port or None)
    worker = None
    node_workers: list[subprocess.Popen[bytes]] = []
    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        env["PREFECT_API_URL"] = api
        deploy_all(env, pool)
        ui = api.removesuffix("/api")
        typer.echo(f"Prefect UI: {ui}\nPREFECT_API_URL={api}\n"
                   f"deployments from {REPO / 'prefect.yaml'} on work pool '{pool}'; a worker runs them until Ctrl-C")
        worker = start_worker(pool, env)
        node_env = {environ.NODE_ADDR: "127.0.0.1", **env}  # nodes on this machine meet on loopback
        for node in [n.strip() for n in nodes.split(",") if n.strip()]:
            node_workers.append(start_node_worker(node, node_env))
            typer.echo(f"node {node}: a worker on work queue '{node}' of pool '{NODE_POOL}'")
        while not stopping and worker.poll() is None:
            time.sleep(0.2)
    finally:
        for process in [*node_workers, *([worker] if worker is not None else [])]:
            stop_group(process)
        stop_group(server)
        typer.echo("stopped the workers and the server")
