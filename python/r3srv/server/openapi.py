"""The published OpenAPI schema, made to describe what is served.

Litestar documents its own 400 body (`status_code`, `detail`, `extra`) and JSON for every 200;
r3srv answers every error in OpenAI's shape, and the generation routes stream server-sent
events when asked to. `describe_what_is_served` rewrites the generated schema once, at start-up:
each operation's error statuses point at ErrorResponse, the streaming routes' 200 also lists
text/event-stream, a request field's bounds are those its body is decoded by
(server/openapi_bounds.py), and a server with keys documents the bearer scheme, which operations
need a key (from their declared access, as server/auth.py reads it) and their 401 and 403.
tests/test_server_schema.py fuzzes the running server against it (schemathesis).
"""

from __future__ import annotations

from litestar import Litestar
from litestar.openapi.spec import (
    Components,
    OpenAPIMediaType,
    OpenAPIResponse,
    OpenAPIType,
    Reference,
    Schema,
    SecurityScheme,
)

from r3srv.server.auth import FORBIDDEN, UNAUTHORIZED, ApiKeys
from r3srv.server.declare import Access, access_by_path
from r3srv.server.openapi_bounds import body_types, restore_bounds
from r3srv.server.routes import ROUTE_HANDLERS

# Every operation may answer these (OpenAI's error shape): a bad request, an unknown model or a
# route the server was started without, a body over --max-request-body-bytes, an engine that
# is not running.
ERROR_STATUSES = {
    "400": "Invalid request (the error's param names the field)",
    "404": "Unknown model, or an endpoint this server was started without",
    "413": "Request body larger than --max-request-body-bytes",
    "503": "The engine is not running (shut down, or its loop died)",
}
STREAMING_ROUTES = ("/v1/completions", "/v1/chat/completions", "/inference/v1/generate", "/generate")
_METHODS = ("get", "put", "post", "delete", "patch")


BEARER = "bearer"  # the security scheme's name in components.securitySchemes


def describe_what_is_served(app: Litestar, keys: ApiKeys) -> None:
    schema = app.openapi_schema  # built once and cached: what /schema/openapi.json renders
    access = access_by_path(ROUTE_HANDLERS)
    if schema.components is not None and schema.components.schemas:
        restore_bounds(schema.components.schemas, body_types(ROUTE_HANDLERS))
    if keys.enabled:
        components = schema.components or Components()
        components.security_schemes = {**(components.security_schemes or {}), BEARER: SecurityScheme(
            type="http", scheme="bearer", description="--api-key (inference routes) or --admin-api-key (admin routes)")}
        schema.components = components
    error = OpenAPIMediaType(schema=Reference(ref="#/components/schemas/ErrorResponse"))
    # one server-sent event (as clients parse the stream): its data is a JSON chunk, or [DONE] last
    event = Schema(type=OpenAPIType.OBJECT, required=["data"], description="data: {...} events, then data: [DONE]",
                   properties={"data": Schema(type=OpenAPIType.STRING), "event": Schema(type=OpenAPIType.STRING),
                               "id": Schema(type=OpenAPIType.STRING), "retry": Schema(type=OpenAPIType.INTEGER)})
    events = OpenAPIMediaType(schema=event)
    for path, item in (schema.paths or {}).items():
        for method in _METHODS:
            operation = getattr(item, method, None)
            if operation is None:
                continue
            responses = operation.responses if operation.responses is not None else {}
            for status, description in ERROR_STATUSES.items():
                responses[status] = OpenAPIResponse(description=description, content={"application/json": error})
            ok = responses.get("200")
            _union_as_any_of(ok)
            if path in STREAMING_ROUTES and isinstance(ok, OpenAPIResponse):
                ok.content = {**(ok.content or {}), "text/event-stream": events}
            needs = keys.refusal(access.get(path, Access.INFERENCE), None) is not None
            if needs:
                responses[str(UNAUTHORIZED)] = OpenAPIResponse(
                    description="No key, or not one of the server's", content={"application/json": error})
                operation.security = [{BEARER: []}]
            if access.get(path) is Access.ADMIN:
                responses[str(FORBIDDEN)] = OpenAPIResponse(
                    description="An API key on an admin route (it needs an admin key), or a weight directory or "
                    "trainer host outside the allowed ones", content={"application/json": error})
            operation.responses = responses


def _union_as_any_of(ok: OpenAPIResponse | Reference | None) -> None:
    """A handler returning a union (vLLM's tokens- and text-level generate responses) is
    documented by Litestar as oneOf, but its shapes overlap (a choice without logprobs fits
    both), so an answer would match more than one: anyOf says what is served."""
    media = (ok.content or {}).get("application/json") if isinstance(ok, OpenAPIResponse) else None
    schema = media.schema if media is not None else None
    if isinstance(schema, Schema) and schema.one_of:
        schema.any_of, schema.one_of = schema.one_of, None
