"""Bearer keys: which key a request needs, read from its route's declared access (server/declare.py).

As vLLM and SGLang spell it: `Authorization: Bearer <key>`. Three kinds of route:

- `Access.PROBE` (/health, /metrics, the router's load probes): open, so that load balancers,
  routers and Prometheus need no secret (as SGLang keeps /health* and /metrics open); with
  `protect_probes` they need an inference key like any other route;
- `Access.INFERENCE` (generation, tokenizing, discovery, and any path no route declares: the
  OpenAPI schema, unknown paths, so that nothing is enumerable without a key): an API key or an
  admin key, once API keys are set; open without API keys (admin keys alone guard admin routes);
- `Access.ADMIN` (control, weights, memory, process groups): an admin key once admin keys are
  set (an API key there is a 403: known, not allowed); without admin keys, the API keys guard
  them too.

Keys are kept as SHA-256 digests and every digest is compared, in constant time, whatever the
outcome (vLLM's way: the time taken says nothing about which key nearly matched). No key is ever
logged or put in an error message. The layer answers before the body is read.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from r3srv.server.declare import Access
from r3srv.server.errors import error_body

UNAUTHORIZED, FORBIDDEN = 401, 403


def _digests(keys: Iterable[str]) -> tuple[bytes, ...]:
    return tuple(hashlib.sha256(key.encode("utf-8")).digest() for key in keys)


def bearer_token(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header (scheme case-insensitive), else None."""
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    return token if scheme.lower() == "bearer" and token else None


def _any_equal(token: str, digests: tuple[bytes, ...]) -> bool:
    digest = hashlib.sha256(token.encode("utf-8")).digest()
    found = False
    for expected in digests:  # no early exit: every key is compared
        found |= secrets.compare_digest(digest, expected)
    return found


@dataclass(frozen=True)
class ApiKeys:
    """The server's keys (digests only) and whether probes need one."""

    api: tuple[bytes, ...] = ()
    admin: tuple[bytes, ...] = ()
    protect_probes: bool = False
    # What this server sends when it forwards a control call to its fleet peers (server/fanout.py):
    # an admin key, else an API key. Kept out of repr so that no log line can print it.
    fleet_credential: str | None = field(default=None, repr=False)

    @classmethod
    def from_keys(cls, api: Iterable[str] = (), admin: Iterable[str] = (), *, protect_probes: bool = False) -> ApiKeys:
        api, admin = [k for k in api if k], [k for k in admin if k]
        credential = (admin or api or [None])[0]
        return cls(_digests(api), _digests(admin), protect_probes, credential)

    @property
    def enabled(self) -> bool:
        return bool(self.api or self.admin)

    def refusal(self, access: Access, authorization: str | None) -> int | None:
        """None when a request with this Authorization header may call a route of `access`;
        else 401 (no key, or not one of ours) or 403 (an API key on an admin route)."""
        if access is Access.PROBE and not self.protect_probes:
            return None
        token = bearer_token(authorization)
        is_admin = token is not None and _any_equal(token, self.admin)
        is_api = token is not None and _any_equal(token, self.api)
        if access is Access.ADMIN and self.admin:
            return None if is_admin else FORBIDDEN if is_api else UNAUTHORIZED
        if not self.api:  # no API keys: inference routes are open; admin routes too without admin keys
            return None
        return None if is_api or is_admin else UNAUTHORIZED


def _message(status: int, access: Access, path: str) -> str:
    if status == FORBIDDEN:
        return f"{path} is an admin route: it needs an admin key (--admin-api-key), not an API key"
    which = "an admin key (--admin-api-key)" if access is Access.ADMIN else "an API key (--api-key)"
    return f"{path} needs {which}: send it as `Authorization: Bearer <key>`"


class Authenticate:
    """ASGI layer in front of the app: refuses a request whose route needs a key it lacks.

    `access_by_path`: every declared route's access (declare.access_by_path); a path not in it
    is treated as an inference route."""

    def __init__(self, app: Any, keys: ApiKeys, access_by_path: dict[str, Access]) -> None:
        self.app = app
        self.keys = keys
        self.access_by_path = access_by_path

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        access = self.access_by_path.get(path, Access.INFERENCE)
        authorization = next((value.decode("latin-1") for name, value in scope["headers"]
                              if name == b"authorization"), None)
        status = self.keys.refusal(access, authorization)
        if status is None:
            await self.app(scope, receive, send)
            return
        body = msgspec.json.encode(error_body(status, _message(status, access, path)))
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if status == UNAUTHORIZED:
            headers.append((b"www-authenticate", b'Bearer realm="r3srv"'))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
