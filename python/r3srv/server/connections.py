"""Connections that stall before their request is in: deadlines, and a clean answer on shutdown.

uvicorn closes idle keep-alive connections, but a connection that opens and sends nothing, or
half its headers, or half its body, would hold its socket (and, for a body, the request's
handler) forever. `guarded_h11(header_timeout, body_timeout, min_body_rate)` is uvicorn's h11
protocol with:

- a header deadline: the request line and headers must be in within `header_timeout` seconds
  of the first byte of the request (of the connection, for its first request);
- a body idle timeout: while the body comes in, a pause of more than `body_timeout` seconds
  between two reads closes the connection;
- a body rate (Apache mod_reqtimeout's MinRate): the body's deadline is `body_timeout` seconds
  after it began, pushed back by one second for every `min_body_rate` bytes received. A body
  trickled in a byte at a time (which the idle timeout alone never cuts) is closed about
  `body_timeout` seconds in, while a slow but real upload (above the rate on average) is read to
  its end, however long the body. Time the server itself stops reading (flow control) is not
  counted against the client;
- shutdown (SIGTERM) with a body half in: the client gets a 503 in OpenAI's error shape and
  the connection closes, instead of the handler waiting for the body until uvicorn's graceful
  period ends and uvicorn answers its own plain-text 500.

The handler of a connection closed mid-body sees the client disconnect (counted as 499).
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
import msgspec
from uvicorn.protocols.http.h11_impl import H11Protocol

from r3srv.server.errors import error_body


class _GuardedH11Protocol(H11Protocol):
    header_timeout: float  # set by guarded_h11 (the CLI's --timeout-headers, --timeout-body, --min-body-rate)
    body_timeout: float
    min_body_rate: float  # bytes per second

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._waiting_for: str | None = None  # "headers" or "body" while a deadline runs
        self._body_deadline: float | None = None  # loop time the body in progress must be in by

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm("headers", self.header_timeout)

    def data_received(self, data: bytes) -> None:
        in_body = self._body_deadline is not None and self.conn.their_state is h11.SEND_BODY
        super().data_received(data)
        if in_body:  # every min_body_rate bytes of this body buy it one more second
            self._body_deadline += len(data) / self.min_body_rate
        self._follow()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _follow(self) -> None:
        """Arm the deadline that fits where the client's side of the request is now."""
        if self.transport is None or self.transport.is_closing():
            return
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            now = self.loop.time()
            if self._body_deadline is None:
                self._body_deadline = now + self.body_timeout
            # restarted by every read: the idle timeout, or the rate's deadline if sooner
            self._arm("body", max(0.0, min(self.body_timeout, self._body_deadline - now)))
            return
        self._body_deadline = None
        if state is h11.IDLE and self.conn.trailing_data[0]:
            if self._waiting_for != "headers":  # the next request's first bytes: its headers are due
                self._arm("headers", self.header_timeout)
        else:  # request complete (the handler runs), or idle between requests (keep-alive's timer)
            self._disarm()

    def _arm(self, what: str, seconds: float) -> None:
        self._disarm()
        self._waiting_for = what
        self._deadline = self.loop.call_later(seconds, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = None
        self._waiting_for = None

    def _expired(self) -> None:
        self._deadline = None
        if self._waiting_for == "body" and self.flow.read_paused:  # we stopped reading, not the client
            self._body_deadline = max(self._body_deadline or 0.0, self.loop.time() + self.body_timeout)
            self._arm("body", self.body_timeout)
            return
        self._waiting_for = None
        if not self.transport.is_closing():
            self.transport.close()

    def shutdown(self) -> None:
        cycle = self.cycle
        if cycle is not None and not cycle.response_started and self.conn.their_state is h11.SEND_BODY:
            self._answer_and_close(503, "the server is shutting down; send the request again")
            return
        super().shutdown()

    def _answer_and_close(self, status: int, message: str) -> None:
        body = msgspec.json.encode(error_body(status, message))
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        try:
            out = self.conn.send(h11.Response(status_code=status, headers=headers))
            out = (out or b"") + (self.conn.send(h11.Data(data=body)) or b"") + (self.conn.send(h11.EndOfMessage()) or b"")
        except h11.LocalProtocolError:
            out = b""
        if self.cycle is not None:  # the handler reads a disconnect; its own answer, if any, is dropped
            self.cycle.disconnected = True
            self.cycle.message_event.set()
        if out:
            self.transport.write(out)
        self.transport.close()


def guarded_h11(header_timeout: float, body_timeout: float, min_body_rate: float) -> type[H11Protocol]:
    """uvicorn's `http` protocol class with these deadlines (seconds) and body rate (bytes per second)."""
    return type("GuardedH11Protocol", (_GuardedH11Protocol,),
                {"header_timeout": header_timeout, "body_timeout": body_timeout, "min_body_rate": min_body_rate})
