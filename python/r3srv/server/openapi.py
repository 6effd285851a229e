"""The published OpenAPI schema, made to describe what is served.

Litestar documents its own 400 body (`status_code`, `detail`, `extra`) and JSON for every 200;
r3srv answers every error in OpenAI's shape, and the generation routes stream server-sent
events when asked to. `describe_what_is_served` rewrites the generated schema once, at start-up:
each operation's error statuses point at ErrorResponse, and the streaming routes' 200 also lists
text/event-stream. tests/test_server_schema.py fuzzes the running server against it (schemathesis).
"""

from __future__ import annotations

from litestar import Litestar
from litestar.openapi.spec import OpenAPIMediaType, OpenAPIResponse, OpenAPIType, Reference, Schema

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


def describe_what_is_served(app: Litestar) -> None:
    schema = app.openapi_schema  # built once and cached: what /schema/openapi.json renders
    error = OpenAPIMediaType(schema=Reference(ref="#/components/schemas/ErrorResponse"))
    events = OpenAPIMediaType(schema=Schema(type=OpenAPIType.STRING, description="data: {...} lines, then data: [DONE]"))
    for path, item in (schema.paths or {}).items():
        for method in _METHODS:
            operation = getattr(item, method, None)
            if operation is None:
                continue
            responses = operation.responses if operation.responses is not None else {}
            for status, description in ERROR_STATUSES.items():
                responses[status] = OpenAPIResponse(description=description, content={"application/json": error})
            ok = responses.get("200")
            if path in STREAMING_ROUTES and isinstance(ok, OpenAPIResponse):
                ok.content = {**(ok.content or {}), "text/event-stream": events}
            operation.responses = responses
