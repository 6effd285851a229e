"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the right status.

The `openai` SDK picks its exception class from the status (400 BadRequestError,
404 NotFoundError, 413 APIStatusError, ...), and reads `error.message`. Every
exception that reaches Litestar goes through `error_response`, so no request,
however malformed, gets anything but this shape.
"""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any

import msgspec
from litestar import MediaType, Request, Response
from litestar.exceptions import HTTPException, ValidationException

from r3srv.errors import InvalidRequestError, PermissionDeniedError, R3srvError
from r3srv.server.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger("r3srv.server")

# ASGI scope key: the decoded request's `param_names()`, engine field name -> the client's
PARAM_NAMES = "r3srv.param_names"

# The `type` string vLLM puts in its errors, by status.
_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestEntityTooLargeError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class ModelNotFoundError(R3srvError):
    """The request names a model this server does not serve (HTTP 404)."""

    def __init__(self, model: str) -> None:
        super().__init__(f"The model `{model}` does not exist.")
        self.param = "model"


class EndpointDisabledError(R3srvError):
    """An endpoint that this server was started without (HTTP 404)."""

    def __init__(self, path: str, flag: str) -> None:
        super().__init__(f"{path} is disabled: start the server with {flag} to allow it")


def error_body(status: int, message: str, param: str | None = None) -> ErrorResponse:
    error_type = _ERROR_TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "") + "Error"
    return ErrorResponse(error=ErrorInfo(message=message, type=error_type, param=param, code=status))


def error_response(status: int, message: str, param: str | None = None) -> Response[bytes]:
    body = msgspec.json.encode(error_body(status, message, param))
    return Response(body, status_code=status, media_type=MediaType.JSON)


def _validation_message(exc: ValidationException) -> tuple[str, str | None]:
    """Litestar puts msgspec's decode errors in `extra`: [{"message": "Expected `int`, got `str`", "key": "n"}]."""
    extra: Any = exc.extra
    items = extra if isinstance(extra, list) else [extra] if extra else []
    parts: list[str] = []
    param = None
    for item in items:
        if isinstance(item, dict):
            key = item.get("key")
            key = None if key in (None, "", "data") else str(key)
            param = param or key
            parts.append(f"`{key}`: {item.get('message', '')}" if key else str(item.get("message", "")))
        else:
            parts.append(str(item))
    return "Invalid request body: " + ("; ".join(parts) or str(exc.detail)), param


def handle_exception(request: Request[Any, Any, Any], exc: Exception) -> Response[bytes]:
    """The one exception handler: maps every exception to an OpenAI error body."""
    if isinstance(exc, ValidationException):
        message, param = _validation_message(exc)
        return error_response(400, message, param)
    if isinstance(exc, HTTPException):
        status = exc.status_code
        message = str(exc.detail) if exc.detail else HTTPStatus(status).phrase
        if status == 404 and exc.detail == "Not Found":
            message = f"Not found: {request.method} {request.url.path}"
        if status == 405:
            message = f"Method {request.method} not allowed on {request.url.path}"
        return error_response(status, message)
    if isinstance(exc, (ModelNotFoundError, EndpointDisabledError)):
        return error_response(404, str(exc), getattr(exc, "param", None))
    if isinstance(exc, PermissionDeniedError):
        return error_response(403, str(exc), exc.param)
    if isinstance(exc, InvalidRequestError):
        exc = exc.renamed(request.scope.get(PARAM_NAMES) or {})  # type: ignore[call-overload]
        return error_response(400, str(exc), exc.param)
    if isinstance(exc, msgspec.ValidationError):
        return error_response(400, str(exc))
    if isinstance(exc, R3srvError):  # e.g. the engine is shut down or its thread died
        logger.error("engine error on %s %s: %s", request.method, request.url.path, exc)
        return error_response(503, f"{type(exc).__name__}: {exc}")
    logger.exception("unhandled error on %s %s", request.method, request.url.path)
    return error_response(500, f"Internal server error: {type(exc).__name__}: {exc}")
