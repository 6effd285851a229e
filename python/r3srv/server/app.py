"""The Litestar application: routes, OpenAI-shaped errors, engine lifetime, request metrics.

`create_app` takes an engine that is already built (the CLI builds it first, so a
bad configuration fails before any port is bound) and owns it from then on: the
lifespan shuts it down when the server stops.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from litestar import Litestar, Request
from litestar.datastructures import State
from litestar.exceptions import ClientException
from litestar.openapi import OpenAPIConfig
from litestar.types import Message, Receive, Scope, Send

import r3srv
from r3srv.server.errors import handle_exception
from r3srv.server.generation import ServerState
from r3srv.server.metrics import ServerMetrics
from r3srv.server.routes import ROUTE_HANDLERS

DEFAULT_MAX_REQUEST_BODY_BYTES = 32 * 1024 * 1024


class _Request(Request):
    async def json(self) -> Any:
        try:
            return await super().json()
        except RecursionError:  # msgspec's answer to hostile nesting; a client error, not a 500
            raise ClientException("Invalid request body: JSON nested too deeply") from None


def create_app(
    engine: Any,
    *,
    served_model_name: str,
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
    enable_weight_updates: bool = False,
    weight_sync_timeout: float = 600.0,
) -> Litestar:
    state = ServerState(
        engine=engine,
        model_name=served_model_name,
        metrics=ServerMetrics(engine.stats),
        enable_weight_updates=enable_weight_updates,
        weight_sync_timeout=weight_sync_timeout,
    )

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await asyncio.to_thread(engine.shutdown)  # joins the engine thread: keep the loop free

    return Litestar(
        route_handlers=ROUTE_HANDLERS,
        state=State({"server": state}),
        lifespan=[lifespan],
        exception_handlers={Exception: handle_exception},
        request_class=_Request,
        request_max_body_size=max_request_body_bytes,
        openapi_config=OpenAPIConfig(title="r3srv", version=r3srv.__version__),
        debug=False,
        logging_config=None,
    )


class CountRequests:
    """Outermost ASGI layer: counts every HTTP request by route and status, 404s and 405s included."""

    def __init__(self, app: Litestar) -> None:
        self.app = app
        self.state: ServerState = app.state.server
        self._metrics = self.state.metrics
        self._routes = {path for handler in ROUTE_HANDLERS for path in handler.paths}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_counting(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_counting)
        finally:
            path = scope["path"]
            route = path if path in self._routes else "other"
            self._metrics.requests.labels(route, str(status)).inc()


def build_asgi_app(engine: Any, **kwargs: Any) -> CountRequests:
    return CountRequests(create_app(engine, **kwargs))
