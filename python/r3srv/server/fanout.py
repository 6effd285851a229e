"""Control calls applied on several servers at once, with one answer.

Two users: the fleet's front (`r3srv serve --data-parallel-size N`, python/r3srv/front/app.py)
sends every call a route declares `Fleet.EVERY_REPLICA` to all its replicas; and a server started
with `--fleet-peer-urls` (the outermost ASGI layer here, FanOutControl) applies such a call
locally and forwards it, at the same time, to every peer. Forwarded calls carry the FANOUT_HEADER
marker, which a receiver applies to itself only (no loops, no second hop).

One answer (`combine`): the first server's when every one succeeded; the common answer when all
failed alike (a bad model_path is the same 400 everywhere, param included); otherwise an error
naming each server that did not apply the call, with its own status and message, and the ones
that did.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import httpx
import msgspec

from r3srv.server.declare import Fleet, paths_declared
from r3srv.server.errors import error_body
from r3srv.server.routes import ROUTE_HANDLERS

FANOUT_HEADER = "x-r3srv-fleet-fanout"
# The routes declared Fleet.EVERY_REPLICA (server/declare.py). Not the process-group calls
# (Fleet.OWN_RANK: /init_weights_update_group, ...): each replica joins the trainer's group with its own rank.
CONTROL_PATHS = paths_declared(ROUTE_HANDLERS, Fleet.EVERY_REPLICA)
# Control bodies are a few fields; a larger one is not a control call.
MAX_CONTROL_BODY_BYTES = 1 << 20
# Loading weights or waiting for requests to finish can take minutes: no read timeout.
PEER_TIMEOUT = httpx.Timeout(None, connect=5.0)
UNREACHABLE = 502
# Request headers not passed on to another server (hop by hop, or recomputed for the new body).
HOP_HEADERS = frozenset({b"host", b"content-length", b"connection", b"keep-alive", b"transfer-encoding", b"te",
                         b"trailer", b"upgrade", b"proxy-connection", b"expect"})


@dataclass
class Reply:
    """What one server answered to a call (status UNREACHABLE and `error` when it could not be reached)."""

    name: str
    status: int
    body: bytes = b""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    def why(self) -> str:
        if self.error is not None:
            return f"unreachable ({self.error})"
        try:
            message = msgspec.json.decode(self.body)["error"]["message"]
        except (msgspec.DecodeError, KeyError, TypeError):
            message = self.body[:500].decode(errors="replace")
        return f"HTTP {self.status}: {message}"

    def param(self) -> str | None:
        try:
            return msgspec.json.decode(self.body)["error"]["param"]
        except (msgspec.DecodeError, KeyError, TypeError):
            return None


def forwarded_headers(scope_headers: list[tuple[bytes, bytes]], *extra: tuple[bytes, bytes]) -> list[tuple[bytes, bytes]]:
    """The client's headers (credentials included) for another server, without the hop-by-hop ones."""
    return [(k, v) for k, v in scope_headers if k.lower() not in HOP_HEADERS] + list(extra)


async def call(client: httpx.AsyncClient, name: str, url: str, method: str, headers: list[tuple[bytes, bytes]],
               body: bytes) -> Reply:
    try:
        response = await client.request(method, url, content=body, headers=headers)
    except httpx.HTTPError as exc:
        return Reply(name, UNREACHABLE, error=f"{type(exc).__name__}: {exc}".rstrip(": "))
    return Reply(name, response.status_code, response.content, list(response.headers.raw))


def combine(path: str, replies: list[Reply], note: str = "") -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """(status, headers, body) of the one answer to a call that `replies` answered; `note` is added to
    the message of a partial failure (what each server serves now, for instance)."""
    failed = [r for r in replies if not r.ok]
    if not failed:
        return replies[0].status, replies[0].headers, replies[0].body
    if len(failed) == len(replies) and len({(r.status, r.body) for r in failed}) == 1:
        return failed[0].status, failed[0].headers, failed[0].body
    statuses = [r.status for r in failed]
    status = max((s for s in statuses if 400 <= s < 500), default=UNREACHABLE)
    applied = [r.name for r in replies if r.ok]
    detail = "; ".join(f"{r.name}: {r.why()}" for r in failed)
    done = f"applied on {', '.join(applied)} but " if applied else ""
    message = f"{path} was {done}not applied on {len(failed)} of {len(replies)}: {detail}{note}"
    params = {r.param() for r in failed}
    payload = msgspec.json.encode(error_body(status, message, params.pop() if len(params) == 1 else None))
    return status, [(b"content-type", b"application/json")], payload


class _Captured:
    """The local app's response, held until the peers have answered."""

    def __init__(self) -> None:
        self.status = 500
        self.headers: list[tuple[bytes, bytes]] = []
        self.body = bytearray()

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            self.headers = list(message.get("headers", []))
        elif message["type"] == "http.response.body":
            self.body += message.get("body", b"")


class FanOutControl:
    """A server's outermost ASGI layer with `--fleet-peer-urls`: control calls reach every peer too."""

    def __init__(self, app: Any, peer_urls: list[str]) -> None:
        self.app = app
        self.state = app.state  # the CLI reaches the server state through the outermost app
        self.peer_urls = [url.rstrip("/") for url in peer_urls]
        self._client: httpx.AsyncClient | None = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] not in CONTROL_PATHS or marked(scope):
            await self.app(scope, receive, send)
            return
        body = await read_body(receive, MAX_CONTROL_BODY_BYTES)
        if body is None:
            await send_json(send, 413, error_body(413, f"a control call's body is at most {MAX_CONTROL_BODY_BYTES} bytes"))
            return
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=PEER_TIMEOUT)
        local = _Captured()
        headers = forwarded_headers(scope["headers"], (FANOUT_HEADER.encode(), b"1"))
        path = target_path(scope)
        replies = await asyncio.gather(
            self.app(scope, replay(body), local.send),
            *(call(self._client, url, url + path, scope["method"], headers, body) for url in self.peer_urls),
        )
        own = Reply("this server", local.status, bytes(local.body), local.headers)
        await send_answer(send, *combine(scope["path"], [own, *replies[1:]]))


def marked(scope: dict[str, Any]) -> bool:
    """Whether the call was forwarded by a front or a peer (apply it here only)."""
    return any(name == FANOUT_HEADER.encode() for name, _ in scope["headers"])


def target_path(scope: dict[str, Any]) -> str:
    query = scope.get("query_string", b"").decode("latin-1")
    return scope["path"] + (f"?{query}" if query else "")


async def read_body(receive: Any, limit: int) -> bytes | None:
    """The whole request body; None when it is over `limit` bytes."""
    chunks = bytearray()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunks += message.get("body", b"")
        if len(chunks) > limit:
            return None
        if not message.get("more_body", False):
            break
    return bytes(chunks)


def replay(body: bytes) -> Any:
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:  # the app reads past the body only to see a disconnect: wait as a live client would
            await asyncio.Event().wait()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return receive


async def send_answer(send: Any, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
    kept = [(k, v) for k, v in headers if k.lower() not in (b"content-length", b"transfer-encoding", b"connection")]
    kept.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": kept})
    await send({"type": "http.response.body", "body": body})


async def send_json(send: Any, status: int, payload: Any) -> None:
    await send_answer(send, status, [(b"content-type", b"application/json")], msgspec.json.encode(payload))
