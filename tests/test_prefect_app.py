"""The servers parashift starts replay a write SQLite refused (Prefect's 503) before the client
hears of it, and pass everything else through untouched; the wrapped `prefect server start`
serves Prefect's API."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from parashift.commands.prefect_app import REPLAYS, ReplayRefusedWrites
from parashift.commands.serve import start_prefect_server, stop_group


class Refusing:
    """An ASGI app that answers 503 (raising after it, as Starlette's error middleware does)
    `refusals` times, then 201 with the body it was sent."""

    def __init__(self, refusals: int) -> None:
        self.refusals, self.calls, self.bodies = refusals, 0, []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        self.calls += 1
        assert scope["path"] == "/api/flow_runs/", scope  # each replay routes the request as sent
        scope["path"] = "/flow_runs/"  # as Starlette's Mount rewrites it for the mounted app
        body = (await receive())["body"]
        self.bodies.append(body)
        if self.calls <= self.refusals:
            await send({"type": "http.response.start", "status": 503, "headers": []})
            await send({"type": "http.response.body", "body": b'{"exception_message": "Service Unavailable"}'})
            raise RuntimeError("database is locked")
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": body})


def call(app: Any, method: str, body: bytes, chunks: int = 1) -> tuple[list[dict[str, Any]], BaseException | None]:
    """The messages the client is sent, and what the call raised."""
    parts = [body[i::chunks] for i in range(chunks)] if chunks > 1 else [body]
    incoming = [{"type": "http.request", "body": part, "more_body": i < len(parts) - 1} for i, part in enumerate(parts)]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return incoming.pop(0) if incoming else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def run() -> None:
        await app({"type": "http", "method": method, "path": "/api/flow_runs/"}, receive, send)

    try:
        asyncio.run(run())
    except Exception as error:  # noqa: BLE001 - returned for the test to read
        return sent, error
    return sent, None


def test_a_refused_write_is_replayed_with_its_body_and_the_client_sees_only_the_answer() -> None:
    inner = Refusing(refusals=2)
    sent, raised = call(ReplayRefusedWrites(inner, pause_s=0.001), "POST", b'{"name": "x"}')
    assert raised is None and inner.calls == 3 and inner.bodies == [b'{"name": "x"}'] * 3
    assert [m.get("status") for m in sent if m["type"] == "http.response.start"] == [201]
    assert sent[-1]["body"] == b'{"name": "x"}'
    assert (b"x-parashift-replays", b"2") in sent[0]["headers"]


def test_a_body_sent_in_chunks_is_replayed_whole() -> None:
    inner = Refusing(refusals=1)
    sent, _ = call(ReplayRefusedWrites(inner, pause_s=0.001), "PATCH", b"0123456789", chunks=3)
    assert inner.bodies == [b"0369147258"] * 2 and sent[-1]["body"] == b"0369147258"


def test_a_refusal_that_lasts_reaches_the_client_as_before() -> None:
    """Past REPLAYS the 503 goes out (and the error is raised again for the server's log): the
    client's own backoff takes over."""
    inner = Refusing(refusals=100)
    sent, raised = call(ReplayRefusedWrites(inner, pause_s=0.001), "POST", b"{}")
    assert inner.calls == REPLAYS + 1 and isinstance(raised, RuntimeError)
    assert [m.get("status") for m in sent if m["type"] == "http.response.start"] == [503]
    assert (b"x-parashift-replays", str(REPLAYS).encode()) in sent[0]["headers"]


@pytest.mark.parametrize("method", ["GET", "HEAD"])
def test_reads_pass_through_once(method: str) -> None:
    inner = Refusing(refusals=1)
    sent, raised = call(ReplayRefusedWrites(inner, pause_s=0.001), method, b"")
    assert inner.calls == 1 and isinstance(raised, RuntimeError)
    assert [m.get("status") for m in sent if m["type"] == "http.response.start"] == [503]


def test_the_wrapped_server_start_serves_prefects_api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`start_prefect_server` (what `parashift serve` and the benches run) answers as Prefect's
    server, through the middleware (a write's answer says how often it was replayed): health, a
    write, and the UI's settings. The port it chose first was taken before the server bound it
    (another process chose it too, seen once in a clean-clone run): it chose another."""
    from parashift.commands import serve

    env = {**os.environ, "PREFECT_HOME": str(tmp_path), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        first, second = taken.getsockname()[1], serve.free_port()
        ports = [first, second]
        monkeypatch.setattr(serve, "free_port", lambda: ports.pop(0))
        server, url = start_prefect_server(env)
    assert url == f"http://127.0.0.1:{second}/api" and not ports
    try:
        request = urllib.request.Request(f"{url}/variables/", data=json.dumps({"name": "replayed", "value": 1}).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            assert response.status == 201 and response.headers["x-parashift-replays"] == "0"
        with urllib.request.urlopen(f"{url}/variables/name/replayed", timeout=30) as response:
            assert json.load(response)["value"] == 1
        with urllib.request.urlopen(url.removesuffix("/api") + "/ui-settings", timeout=30) as response:
            assert response.status == 200
    finally:
        stop_group(server)


def test_a_server_asked_for_a_taken_port_says_so(tmp_path: Path) -> None:
    """A port the user named (`parashift serve --port`) that another process holds: the error
    says what the server said, not only its exit code."""
    env = {**os.environ, "PREFECT_HOME": str(tmp_path), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"prefect server exited with code 1: Port {port} is already in use"):
            start_prefect_server(env, port)
