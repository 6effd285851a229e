"""Typed exceptions shared by the engine and the server (the server maps them to HTTP 4xx)."""

from __future__ import annotations


class R3srvError(Exception):
    """Base of every error r3srv raises on purpose."""


class InvalidRequestError(R3srvError, ValueError):
    """A request the engine cannot serve as asked (HTTP 400). `param` names the offending field."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ConfigError(R3srvError, ValueError):
    """An engine or server configuration that cannot work; raised at start-up, never mid-request."""
