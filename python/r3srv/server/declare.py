"""What each route declares beside its path and body: who may call it, what a fleet does with it,
and which start-up flag it needs.

A route is declared once, on its handler's decorator, and everything else reads the
declaration from the handler's `opt`:

    @post("/pause_generation", status_code=200, summary=...,
          access=Access.ADMIN, fleet=Fleet.EVERY_REPLICA, requires=Feature.WEIGHT_UPDATES)

- the route table (`routes.ROUTE_HANDLERS`) is every handler the route modules define;
- a fleet's front (`front/app.py`) dispatches ONE_REPLICA routes to one replica, fans
  EVERY_REPLICA routes out to all with one answer, and gives each replica its own rank in
  OWN_RANK calls; `--fleet-peer-urls` (`server/fanout.py`) fans EVERY_REPLICA routes out to peers;
- `feature_guard` answers 404 "start the server with FLAG" for a route whose feature is off;
- authentication reads `access` (server/auth.py: which key a request needs).

Every handler must declare `access` and `fleet` (tests/test_route_declarations.py holds it), so a
new control route cannot be forgotten by the fleet or left open by mistake.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler

from r3srv.server.errors import EndpointDisabledError


class Access(enum.Enum):
    """Who may call a route."""

    PROBE = "probe"  # liveness, metrics, version: load balancers and routers probe them
    INFERENCE = "inference"  # generation, tokenizing, discovery: what an API user calls
    ADMIN = "admin"  # control, weights, memory, process groups: what a trainer or operator calls


class Fleet(enum.Enum):
    """What a data-parallel fleet does with a call made to its URL."""

    ONE_REPLICA = "one replica"  # answered by the replica it reaches: generation, discovery, probes
    EVERY_REPLICA = "every replica"  # applied on every replica, one answer: pause, load from disk, flush
    OWN_RANK = "own rank"  # process-group calls: every replica takes part with a rank of its own


@dataclass(frozen=True)
class Ranks:
    """How an OWN_RANK call that joins a trainer's group numbers its ranks: the body field that
    names the world size, and the lowest `rank_offset` the trainer may give (SGLang's and vLLM's
    offsets count the trainer's rank 0, prime-rl's count inference ranks only). A fleet's front
    gives replica i `rank_offset + i * tp_size`. Declared as `ranks=Ranks(...)` beside `fleet`;
    OWN_RANK routes without it use the default."""

    world: str = "world_size"
    lowest_offset: int = 1


class Feature(enum.Enum):
    """A group of routes the server serves only when started with its flag."""

    WEIGHT_UPDATES = "--enable-weight-updates"
    # vLLM serves these only in its development mode (VLLM_SERVER_DEV_MODE=1); r3srv behind their own
    # flags, each of which needs --enable-weight-updates too (cli.py refuses it alone)
    SLEEP_MODE = "--enable-sleep-mode"  # /sleep, /wake_up, /is_sleeping (vLLM's flag name)
    COLLECTIVE_RPC = "--enable-collective-rpc"  # /collective_rpc, its fixed method table (engine/rpc.py)
    LORA = "--enable-lora"  # loading and unloading LoRA adapters (vLLM's and SGLang's flag)


def declaration(handler: BaseRouteHandler) -> tuple[Access, Fleet, Feature | None]:
    """The handler's declared access, fleet behaviour and required feature; KeyError if undeclared."""
    opt = handler.opt
    return opt["access"], opt["fleet"], opt.get("requires")


def paths_declared(handlers: list[Any], fleet: Fleet) -> frozenset[str]:
    """Every path of the handlers that declare `fleet`."""
    return frozenset(path for h in handlers if h.opt.get("fleet") is fleet for path in h.paths)


def access_by_path(handlers: list[Any]) -> dict[str, Access]:
    """Every path of the handlers, with the access its handler declares (server/auth.py reads it)."""
    return {path: h.opt["access"] for h in handlers for path in h.paths}


def feature_guard(connection: ASGIConnection[Any, Any, Any, Any], handler: BaseRouteHandler) -> None:
    """A route whose feature the server was started without answers 404, naming the flag."""
    feature = handler.opt.get("requires")
    if feature is not None and feature not in connection.app.state.server.features:
        raise EndpointDisabledError(connection.url.path, feature.value)
