"""Every route declares who may call it and what a fleet does with it (server/declare.py), and
the server's behaviour follows the declarations: the fleet's fan-out list and the feature gate."""

from __future__ import annotations

import pytest
from litestar.testing import TestClient

from r3srv.server.declare import Access, Feature, Fleet, declaration, paths_declared
from r3srv.server.fanout import CONTROL_PATHS
from r3srv.server.routes import ROUTE_HANDLERS, ROUTE_MODULES


def test_every_route_declares_access_and_fleet():
    undeclared = [h.paths for h in ROUTE_HANDLERS if "access" not in h.opt or "fleet" not in h.opt]
    assert not undeclared, f"routes without an access or fleet declaration: {undeclared}"
    for handler in ROUTE_HANDLERS:
        access, fleet, feature = declaration(handler)
        assert isinstance(access, Access) and isinstance(fleet, Fleet)
        assert feature is None or isinstance(feature, Feature)


def test_route_table_holds_every_handler_the_modules_define():
    from litestar.handlers import HTTPRouteHandler

    defined = {id(v) for m in ROUTE_MODULES for v in vars(m).values() if isinstance(v, HTTPRouteHandler)}
    assert defined == {id(h) for h in ROUTE_HANDLERS}
    paths = [p for h in ROUTE_HANDLERS for p in h.paths]
    assert len(paths) == len(set(paths)), "a path is declared twice"


def test_control_routes_are_admin_and_fanned_out_by_declaration():
    assert CONTROL_PATHS == paths_declared(ROUTE_HANDLERS, Fleet.EVERY_REPLICA)
    for handler in ROUTE_HANDLERS:
        access, fleet, feature = declaration(handler)
        if feature is not None:  # everything that changes weights or engine state
            assert access is Access.ADMIN, handler.paths
        if fleet is Fleet.OWN_RANK:
            assert access is Access.ADMIN, handler.paths
    # generation never fans out; probes stay single
    for path in ("/v1/completions", "/v1/chat/completions", "/generate", "/inference/v1/generate", "/health"):
        assert path not in CONTROL_PATHS


@pytest.fixture(scope="module")
def client_without_weight_updates():
    from r3srv import LLM  # noqa: F401  (the engine package, for AsyncLLM)
    from r3srv.engine.async_llm import AsyncLLM
    from r3srv.server.app import create_app

    engine = AsyncLLM(num_kv_blocks=64, max_num_seqs=4, max_model_len=128)
    app = create_app(engine, served_model_name="m")
    with TestClient(app) as client:
        yield client


@pytest.mark.parametrize("handler", [h for h in ROUTE_HANDLERS if h.opt.get("requires") is not None],
                         ids=lambda h: sorted(h.paths)[0])
def test_feature_gate_follows_the_declaration(client_without_weight_updates, handler):
    """Every route declared to need a start-up flag (--enable-weight-updates, --enable-sleep-mode,
    --enable-collective-rpc) answers 404 naming the flag without it, before its body is read."""
    flag = handler.opt["requires"].value
    for path in handler.paths:
        method = "POST" if "POST" in handler.http_methods else "GET"
        response = client_without_weight_updates.request(method, path, content=b"{not json")
        assert response.status_code == 404, (path, response.text)
        error = response.json()["error"]
        assert flag in error["message"] and path in error["message"]
