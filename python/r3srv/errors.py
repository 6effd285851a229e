"""Typed exceptions shared by the engine and the server (the server maps them to HTTP 4xx)."""

from __future__ import annotations

from collections.abc import Mapping


class R3srvError(Exception):
    """Base of every error r3srv raises on purpose."""


class InvalidRequestError(R3srvError, ValueError):
    """A request the engine cannot serve as asked (HTTP 400). `param` names the offending field.

    Two forms: a free `message`, or a field `problem` (`InvalidRequestError(param="max_tokens",
    problem="=0 must be >= 1")`) whose message is the field name followed by the problem, built
    when read. Only the second form can be `renamed` to the field name a client sent (an SGLang
    client's max_new_tokens is the engine's max_tokens): the name is data, never edited text.
    """

    def __init__(self, message: str | None = None, *, param: str | None = None, problem: str | None = None) -> None:
        if (message is None) == (problem is None):
            raise TypeError("give a message or a field problem, not both")
        if problem is not None and param is None:
            raise TypeError("a field problem needs the field (param)")
        self.param = param
        self.problem = problem
        self._message = message
        super().__init__(str(self))

    def __str__(self) -> str:
        if self.problem is not None:
            return f"{self.param}{self.problem}"
        return self._message or ""

    def renamed(self, names: Mapping[str, str]) -> InvalidRequestError:
        """This error with `param` spelled as the client spelled it (`names`: engine -> client)."""
        if self.param not in names:
            return self
        if self.problem is None:  # a free message names no field by itself
            renamed = InvalidRequestError(self._message, param=names[self.param])
        else:
            renamed = InvalidRequestError(param=names[self.param], problem=self.problem)
        renamed.__cause__ = self.__cause__
        return renamed


class ConfigError(R3srvError, ValueError):
    """An engine or server configuration that cannot work; raised at start-up, never mid-request."""


class PermissionDeniedError(R3srvError):
    """A request for something the server's configuration does not allow it to reach (HTTP 403):
    a weight directory outside --allowed-weight-paths, a trainer host outside
    --allowed-trainer-hosts. `param` names the field."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
