"""Control calls that reach every replica of a fleet: the outermost ASGI layer of a replica with peers.

sglang-router 0.3.2 forwards inference routes and fans out /flush_cache itself, but answers
404 for the RL control routes (/pause_generation, /update_weights_from_disk, ...), so a trainer
could only reach each replica one by one. A replica started with `--fleet-peer-urls` applies
such a call locally and forwards it, at the same time, to every peer with the FANOUT_HEADER
marker, which a peer applies locally only (no loops, no second hop). The answer is the local
one when every replica succeeded; otherwise an error naming each replica that did not.
"""

from __future__ import annotations

import asyncio
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
_PEER_TIMEOUT = httpx.Timeout(None, connect=5.0)


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
    def __init__(self, app: Any, peer_urls: list[str]) -> None:
        self.app = app
        self.state = app.state  # the CLI reaches the server state through the outermost app
        self.peer_urls = [url.rstrip("/") for url in peer_urls]
        self._client: httpx.AsyncClient | None = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if (
            scope["type"] != "http"
            or scope["path"] not in CONTROL_PATHS
            or any(name == FANOUT_HEADER.encode() for name, _ in scope["headers"])
        ):
            await self.app(scope, receive, send)
            return
        body = await _read_body(receive)
        if body is None:
            await _send_json(send, 413, error_body(413, f"a control call's body is at most {MAX_CONTROL_BODY_BYTES} bytes"))
            return
        local = _Captured()
        replayed = _replay(body)
        results = await asyncio.gather(
            self.app(scope, replayed, local.send),
            *(self._forward(url, scope, body) for url in self.peer_urls),
        )
        failures = [failure for failure in results[1:] if failure is not None]
        if failures and 200 <= local.status < 300:
            status = max((code for _, code, _ in failures), default=502)
            detail = "; ".join(f"{url}: HTTP {code}: {text}" for url, code, text in failures)
            message = (f"{scope['path']} was applied on this replica but failed on {len(failures)} of "
                       f"{len(self.peer_urls)} peers: {detail}")
            await _send_json(send, status, error_body(status, message))
            return
        await send({"type": "http.response.start", "status": local.status, "headers": local.headers})
        await send({"type": "http.response.body", "body": bytes(local.body)})

    async def _forward(self, url: str, scope: dict[str, Any], body: bytes) -> tuple[str, int, str] | None:
        """None when the peer applied the call; else (peer, status, why); 502 when it cannot be reached."""
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=_PEER_TIMEOUT)
        query = scope.get("query_string", b"").decode("latin-1")
        target = url + scope["path"] + (f"?{query}" if query else "")
        headers = {FANOUT_HEADER: "1", "content-type": "application/json"}
        try:
            response = await self._client.request(scope["method"], target, content=body, headers=headers)
        except httpx.HTTPError as exc:
            return url, 502, f"unreachable ({type(exc).__name__}: {exc})"
        if response.is_success:
            return None
        status = response.status_code if 400 <= response.status_code < 500 else 502
        return url, status, response.text[:500]


async def _read_body(receive: Any) -> bytes | None:
    chunks = bytearray()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunks += message.get("body", b"")
        if len(chunks) > MAX_CONTROL_BODY_BYTES:
            return None
        if not message.get("more_body", False):
            break
    return bytes(chunks)


def _replay(body: bytes) -> Any:
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:  # the app reads past the body only to see a disconnect: wait as a live client would
            await asyncio.Event().wait()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return receive


async def _send_json(send: Any, status: int, payload: Any) -> None:
    body = msgspec.json.encode(payload)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
