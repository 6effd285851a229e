"""One request, forwarded to one replica: the body unchanged, the answer unchanged.

Server-sent events pass through chunk by chunk as the replica writes them; any other answer is
read whole first (a completion's JSON is written at its end anyway), so that a replica dying
halfway through becomes a clean error instead of a cut body. A client that goes away closes the
connection to the replica, which aborts the request there and frees its KV blocks, as it would
for a client of its own.
"""

from __future__ import annotations

import contextlib
from typing import Any

import httpx
import msgspec

from r3srv.server.errors import error_body
from r3srv.server.fanout import send_answer, send_json

# Response headers the front does not copy: it frames the body itself.
_FRAMING = frozenset({b"content-length", b"transfer-encoding", b"connection", b"keep-alive"})
# Replica failures the client sees: the request never reached it (another replica may serve it) ...
NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout)
# ... and failures once it had (the replica died, or closed the connection).
DIED = 503


class ReplicaFailed(Exception):
    """The replica went away after the request reached it; `started`: the client already has the headers."""

    def __init__(self, why: str, started: bool) -> None:
        super().__init__(why)
        self.started = started


async def forward(client: httpx.AsyncClient, url: str, scope: dict[str, Any], headers: list[tuple[bytes, bytes]],
                  body: bytes, send: Any) -> None:
    """Send the request to `url` and its answer to the client. NOT_SENT errors propagate (nothing
    was sent to the client: the caller may try another replica); ReplicaFailed after that."""
    request = client.build_request(scope["method"], url, headers=headers, content=body)
    try:
        response = await client.send(request, stream=True)
    except NOT_SENT:
        raise
    except httpx.HTTPError as exc:  # it had the request, and went away before answering
        raise ReplicaFailed(f"{type(exc).__name__}: {exc}".rstrip(": "), started=False) from exc
    started = False
    try:
        kept = [(k, v) for k, v in response.headers.raw if k.lower() not in _FRAMING]
        if response.headers.get("content-type", "").startswith("text/event-stream"):
            await send({"type": "http.response.start", "status": response.status_code, "headers": kept})
            started = True
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        else:
            content = await response.aread()
            await send_answer(send, response.status_code, kept, content)
    except httpx.HTTPError as exc:
        raise ReplicaFailed(f"{type(exc).__name__}: {exc}".rstrip(": "), started) from exc
    finally:
        await response.aclose()


async def send_failure(send: Any, name: str, exc: ReplicaFailed) -> None:
    """A replica that died mid-request: a 503 the client (or its SDK) can retry, or, mid-stream,
    an OpenAI-shaped error event and the end of the stream."""
    message = f"{name} failed while serving this request ({exc}); the fleet restarts it: retry"
    if not exc.started:
        await send_json(send, DIED, error_body(DIED, message))
        return
    event = b"data: " + msgspec.json.encode(error_body(DIED, message)) + b"\n\n"
    with contextlib.suppress(Exception):
        await send({"type": "http.response.body", "body": event + b"data: [DONE]\n\n"})
