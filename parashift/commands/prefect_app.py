"""Prefect's API server as parashift starts it: Prefect's own app, with writes that SQLite
refused replayed within a second before the client hears of them.

On SQLite (Prefect's default database) a write whose transaction began as a read is refused
at once when another process wrote meanwhile ("database is locked"); Prefect's server answers
503, and its client waits 2 s, then 4 s, before it tries again. Where several processes write
at once (a job's flow, node workers, launchers as they end, a pool's controller) that wait
lands in a job's launch: 2-4 s on 16 of 70 node launches, measured (BENCHMARKS.md, thirty-ninth
session). Replayed here after 50-250 ms, the write almost always goes through; a write still
refused after REPLAYS is answered 503 as before, so the client's own, longer backoff still
covers a lock that lasts. Prefect's client retries these same requests itself, so a replay
here is no less safe than what it already does.

    python -m parashift.commands.prefect_app server start --host 127.0.0.1 --port 4200
    uvicorn --factory parashift.commands.prefect_app:create_app     # the embedded API
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[MutableMapping[str, Any], Receive, Send], Awaitable[None]]

REPLAYS = 5
PAUSE_S = 0.05  # the pause before replay k is k x this: 0.75 s in all
WRITES = frozenset({"POST", "PUT", "PATCH", "DELETE"})
REFUSED = 503  # what Prefect's server answers for a write its database refused (retryable)
# On every write's answer: how many times it was replayed (a client or `curl -i` sees that the
# middleware is in place, and how often SQLite refused).
REPLAYS_HEADER = b"x-parashift-replays"


class _HeldAnswer:
    """The app's answer, passed on unless it is a refusal that will be replayed (then held back)."""

    def __init__(self, send: Send, hold_refusal: bool, replay: int) -> None:
        self.send, self.hold_refusal, self.refused, self.replay = send, hold_refusal, False, replay

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            if message["status"] == REFUSED and self.hold_refusal:
                self.refused = True
            message = {**message, "headers": [*message.get("headers", []), (REPLAYS_HEADER, str(self.replay).encode())]}
        if not self.refused:
            await self.send(message)


def _body_then(body: bytes, receive: Receive) -> Receive:
    """The request's body (read once, given to every replay), then the client's own messages
    (a disconnect)."""
    given = False

    async def replayed() -> Message:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


class ReplayRefusedWrites:
    """ASGI middleware: a write answered 503 is run again, up to `replays` times, before its
    503 goes out. Everything else (reads, websockets, the lifespan) passes through as is."""

    def __init__(self, app: ASGIApp, replays: int = REPLAYS, pause_s: float = PAUSE_S) -> None:
        self.app, self.replays, self.pause_s = app, replays, pause_s

    async def __call__(self, scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in WRITES:
            await self.app(scope, receive, send)
            return
        body = b""
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before its request was whole: nothing to answer
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        for replay in range(self.replays + 1):
            answer = _HeldAnswer(send, hold_refusal=replay < self.replays, replay=replay)
            try:  # a fresh scope each time: routing rewrites it (a mounted app's root_path, ...)
                await self.app(dict(scope), _body_then(body, receive), answer)
            except Exception:
                # Starlette raises the error again after its handler answered (for the server's
                # log): a held refusal is replayed, anything else is the server's to log.
                if not answer.refused:
                    raise
            if not answer.refused:
                return
            await asyncio.sleep(self.pause_s * (replay + 1))


def create_app() -> ASGIApp:
    """Prefect's app (its factory, as uvicorn calls it), wrapped."""
    from prefect.server.api.server import create_app as prefect_create_app

    return ReplayRefusedWrites(prefect_create_app())


def main() -> None:
    """Prefect's CLI on this command's arguments, with every app it creates wrapped (`prefect
    server start` builds its app with `prefect.server.api.server.create_app`, looked up when it
    starts)."""
    import prefect.server.api.server as prefect_server
    from prefect.cli import app as prefect_cli

    unwrapped = prefect_server.create_app

    def wrapped(*args: Any, **kwargs: Any) -> ASGIApp:
        return ReplayRefusedWrites(unwrapped(*args, **kwargs))

    prefect_server.create_app = wrapped  # type: ignore[assignment]
    sys.argv[0] = "prefect"  # Prefect's CLI reads sys.argv itself
    prefect_cli()


if __name__ == "__main__":
    main()
