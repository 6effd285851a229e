"""Fixtures shared by the ported peer tests (tests/test_peer_*.py): each module defines its own
`server` fixture (its flags) and imports these, which talk to it. Every module runs twice: against
one `r3srv serve`, and against a `--data-parallel-size 2` fleet's one URL (its front), which must
answer the same."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from server_fixture import TEST_SERVER_ARGS, RemoteServer


@pytest.fixture(scope="module", params=["server", "fleet"])
def topology(request) -> tuple[str, ...]:
    """The flags that make one server or a 2-replica fleet."""
    return ("--data-parallel-size", "2") if request.param == "fleet" else ()


def serve(topology: tuple[str, ...], *args: str) -> Iterator[RemoteServer]:
    """Body of a module's `server` fixture: `r3srv serve ARGS` (one server or a fleet, as
    `topology` says) on the test settings, stopped cleanly."""
    with RemoteServer(*topology, *args, *TEST_SERVER_ARGS) as srv:
        yield srv
    assert srv.returncode == 0, srv.log


@pytest.fixture(scope="module")
def http(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def model(http) -> str:
    return http.get("/v1/models").json()["data"][0]["id"]
