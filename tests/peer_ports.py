"""Fixtures shared by the ported peer tests (tests/test_peer_*.py): each module defines its own
`server` fixture (its flags) and imports these, which talk to it."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from server_fixture import TEST_SERVER_ARGS, RemoteServer


def serve(*args: str) -> Iterator[RemoteServer]:
    """Body of a module's `server` fixture: `r3srv serve ARGS` on the test settings, stopped cleanly."""
    with RemoteServer(*args, *TEST_SERVER_ARGS) as srv:
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
