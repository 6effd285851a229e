"""The Litestar application: routes, OpenAI-shaped errors, engine lifetime, request metrics.

`create_app` takes an engine that is already built (the CLI builds it first, so a
bad configuration fails before any port is bound) and owns it from then on: the
lifespan shuts it down when the server stops.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any

from litestar import Litestar, Request
from litestar.datastructures import State
from litestar.openapi import OpenAPIConfig
from litestar.types import Message, Receive, Scope, Send

import r3srv
from r3srv.kernels.openmp_team import serial_torch_here
from r3srv.server.auth import ApiKeys, Authenticate
from r3srv.server.body import decode_body
from r3srv.server.chat_output import ChatParsers
from r3srv.server.confinement import Confinement
from r3srv.server.declare import access_by_path, feature_guard
from r3srv.server.errors import PARAM_NAMES, handle_exception
from r3srv.server.generation import ServerState
from r3srv.server.metrics import ServerMetrics
from r3srv.server.openapi import describe_what_is_served
from r3srv.server.routes import ROUTE_HANDLERS
from r3srv.server_options import ServerOptions

# How often the server looks whether the engine loop still runs, and how long /health answers
# 503 after it died before the server stops (so a balancer sees it before the port closes).
ENGINE_WATCH_INTERVAL_S = 0.5
ENGINE_DEATH_EXIT_DELAY_S = 2.0

logger = logging.getLogger("r3srv.server")


class _Request(Request):
    async def json(self) -> Any:
        """The body decoded strictly into the handler's `data` Struct (server/body.py); Litestar
        then takes the Struct as it is."""
        data_field = self.route_handler.parsed_data_field
        if data_field is None:
            return await super().json()
        body = await self.body()
        data = decode_body(body, data_field.annotation, self.route_handler.opt.get("fields"))
        param_names = getattr(data, "param_names", None)
        if param_names is not None:  # errors from here on name fields as this client does
            self.scope[PARAM_NAMES] = param_names()  # type: ignore[literal-required]
        return data


def create_app(
    engine: Any,
    *,
    served_model_name: str,
    options: ServerOptions | None = None,
    on_engine_death: Callable[[], None] | None = None,
    chat_parsers: ChatParsers | None = None,
    confinement: Confinement | None = None,
    keys: ApiKeys | None = None,
) -> Litestar:
    """`options`: the serve flags' (server_options.py; None: their defaults). `chat_parsers`: the
    parsers those options name, when already built (the CLI builds them to check the flags before
    the engine). `on_engine_death` is called (once, on the event loop) when the engine loop has
    died: the CLI stops the server and exits non-zero so that an orchestrator restarts it."""
    options = options or ServerOptions()
    state = ServerState(
        engine=engine,
        model_name=served_model_name,
        metrics=ServerMetrics(engine.stats),
        options=options,
        chat_parsers=chat_parsers or ChatParsers.from_options(options),
        media=options.media_policy(),
    )

    async def watch_engine() -> None:
        while engine.is_running:
            await asyncio.sleep(ENGINE_WATCH_INTERVAL_S)
        logger.critical("the engine loop has died (its error is logged above): /health answers 503, and the "
                        "server stops in %.0f s with a non-zero exit status", ENGINE_DEATH_EXIT_DELAY_S)
        await asyncio.sleep(ENGINE_DEATH_EXIT_DELAY_S)
        if on_engine_death is not None:
            on_engine_death()

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        # torch's parallel work is the engine's: the loop's thread and its workers run theirs
        # on one thread each, so that the core thread's OpenMP team is the process's only one
        serial_torch_here()
        asyncio.get_running_loop().set_default_executor(
            ThreadPoolExecutor(thread_name_prefix="r3srv-worker", initializer=serial_torch_here))
        watcher = asyncio.create_task(watch_engine())
        try:
            yield
        finally:
            watcher.cancel()
            await asyncio.to_thread(engine.shutdown)  # joins the engine thread: keep the loop free

    app = Litestar(
        route_handlers=ROUTE_HANDLERS,
        guards=[feature_guard],
        state=State({"server": state, "confinement": confinement or Confinement()}),
        lifespan=[lifespan],
        exception_handlers={Exception: handle_exception},
        request_class=_Request,
        request_max_body_size=options.max_request_body_bytes,
        openapi_config=OpenAPIConfig(title="r3srv", version=r3srv.__version__),
        debug=False,
        logging_config=None,
    )
    describe_what_is_served(app, keys or ApiKeys())
    return app


class CountRequests:
    """Outermost ASGI layer: counts every HTTP request by route and status, 404s, 405s and
    refused keys (401, 403) included.

    A client that goes away before any response starts (mid-upload, or while waiting) received
    nothing: it counts as 499 (nginx's "client closed request"), whatever the handler answered
    into the closed connection."""

    def __init__(self, app: Any, state: ServerState) -> None:
        self.app = app
        self.state = state
        self._metrics = self.state.metrics
        self._routes = {path for handler in ROUTE_HANDLERS for path in handler.paths}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500
        started = gone = False

        async def receive_watching() -> Message:
            nonlocal gone
            message = await receive()
            if message["type"] == "http.disconnect" and not started:
                gone = True
            return message

        async def send_counting(message: Message) -> None:
            nonlocal status, started
            if message["type"] == "http.response.start":
                status, started = message["status"], True
            await send(message)

        try:
            await self.app(scope, receive_watching, send_counting)
        finally:
            path = scope["path"]
            route = path if path in self._routes else "other"
            self._metrics.requests.labels(route, "499" if gone else str(status)).inc()


def build_asgi_app(engine: Any, *, fleet_peer_urls: list[str] | None = None, keys: ApiKeys | None = None,
                   **kwargs: Any) -> Any:
    """The app behind its ASGI layers, outermost first: request counting, key checks
    (server/auth.py), and with peers the fan-out of control calls to every peer (server/fanout.py),
    which so only ever forwards a call that passed this server's key check."""
    keys = keys or ApiKeys()
    litestar_app = create_app(engine, keys=keys, **kwargs)
    app: Any = litestar_app
    if fleet_peer_urls:
        from r3srv.server.fanout import FanOutControl

        app = FanOutControl(app, fleet_peer_urls, credential=keys.fleet_credential)
    if keys.enabled:
        app = Authenticate(app, keys, access_by_path(ROUTE_HANDLERS))
    return CountRequests(app, litestar_app.state.server)
