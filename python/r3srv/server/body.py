"""Request bodies: UTF-8, the field table's refusals, then msgspec into the route's Struct,
converting values as the peer's own request classes do.

A body of exactly the Struct's types decodes in one strict pass. Otherwise it is decoded to
plain JSON and converted the way pydantic's lax mode converts (`"1234"` into an int, `"true"`
into a bool, `2.0` into an int: server/coerce.py), except the fields the peer types strictly
(SGLang's /generate: `BodyFields.strict_fields()`); what still does not fit is a 400. Litestar
takes the decoded Struct as it is. Every failure is an InvalidRequestError whose `param` is the
field's path as the client wrote it (`sampling_params.max_new_tokens`).
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from r3srv.errors import InvalidRequestError
from r3srv.server.coerce import convert
from r3srv.server.fields import SAMPLING_PARAMS, BodyFields

# msgspec ends its validation messages with " - at `$.a.b[0]`"
_PATH = re.compile(r"^(?P<message>.*) - at `\$(?P<path>[^`]*)`$", re.S)


def _dotted(path: str) -> str:
    """`.messages[0].content` -> `messages.content`; the fields of sampling_params are named
    without it, as vLLM and SGLang name them (`.sampling_params.max_new_tokens` -> `max_new_tokens`)."""
    dotted = re.sub(r"\[\d+\]", "", path).lstrip(".")
    return dotted.removeprefix(f"{SAMPLING_PARAMS}.") if dotted != SAMPLING_PARAMS else dotted


def decode_body(body: bytes, target: Any, fields: BodyFields | None) -> Any:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequestError(f"Invalid request body: not UTF-8 (byte {exc.start})") from None
    try:
        if fields is not None:
            fields.check(text)
        try:
            return msgspec.json.decode(text, type=target, strict=True)
        except msgspec.ValidationError:
            value = msgspec.json.decode(text)  # valid JSON: the types are what failed
        return convert(value, target, fields.strict_fields() if fields is not None else None)
    except msgspec.ValidationError as exc:
        raise _validation_error(exc) from None
    except msgspec.DecodeError as exc:
        raise InvalidRequestError(f"Invalid request body: {exc}") from None
    except RecursionError:  # msgspec's answer to hostile nesting
        raise InvalidRequestError("Invalid request body: JSON nested too deeply") from None


def _validation_error(exc: msgspec.ValidationError) -> InvalidRequestError:
    """msgspec's error -> a 400 naming the field. A check in a Struct's __post_init__ raises an
    InvalidRequestError naming its own field, which msgspec keeps as the cause; msgspec puts the
    path of the object that raised it in the message (the one place the path exists)."""
    match = _PATH.match(str(exc))
    path = _dotted(match["path"]) if match else ""
    message = match["message"] if match else str(exc)
    cause = exc.__cause__
    if isinstance(cause, InvalidRequestError) and cause.param is not None:
        return cause.renamed({cause.param: _dotted(f"{match['path'] if match else ''}.{cause.param}")})
    if path:
        return InvalidRequestError(param=path, problem=f": {message}")
    return InvalidRequestError(f"Invalid request body: {message}")
