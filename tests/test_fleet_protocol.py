"""The single-server protocol tests, run against a fleet's one URL: `r3srv serve
--data-parallel-size 2` must answer every one of them as one `r3srv serve` does (routed experts and
their offsets on every route, streaming, token-id prompts, SGLang's /generate, errors, disconnects
freeing KV blocks, concurrency, /metrics summed over the replicas).

The tests are test_server.py's and test_server_sglang.py's own, imported; only the `server`
fixture differs. Left out: the one that counts a single server's KV pool (256 blocks; the fleet
has two pools, tests/test_fleet.py checks the sum)."""

from __future__ import annotations

import pytest
from server_fixture import TEST_SERVER_ARGS, RemoteServer
from test_server import *  # noqa: F403  (the tests and their fixtures)
from test_server import MAX_BODY
from test_server_sglang import *  # noqa: F403

del test_metrics_count_requests_tokens_and_bytes  # noqa: F821

pytestmark = pytest.mark.slow  # real servers


@pytest.fixture(scope="module")
def server(gate):
    args = ("--enable-return-routed-experts", "--max-request-body-bytes", str(MAX_BODY), "--enable-prompt-tokens-details",
            *TEST_SERVER_ARGS)
    with RemoteServer("--data-parallel-size", "2", *args, step_gate=gate) as srv:  # both replicas behind the gate
        yield srv
    assert srv.returncode == 0, f"SIGTERM should stop the fleet cleanly:\n{srv.log}"
