"""Litestar route handlers, one module per API area.

`ROUTE_HANDLERS` is every handler the modules below define: a route is declared once, on its
handler (path, body, and server/declare.py's access, fleet behaviour and required feature).
"""

from litestar.handlers import HTTPRouteHandler

from r3srv.server.routes import control, fleet, inference, info, lora, openai, sglang, skyrl, weight_sync, weights

ROUTE_MODULES = (openai, inference, sglang, skyrl, info, weights, weight_sync, control, fleet, lora)

ROUTE_HANDLERS: list[HTTPRouteHandler] = [
    value for module in ROUTE_MODULES for value in vars(module).values()
    if isinstance(value, HTTPRouteHandler) and value.fn.__module__ == module.__name__
]
