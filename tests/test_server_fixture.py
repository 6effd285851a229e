"""tests/server_fixture.py's RemoteServer: `own_session` starts the server as the leader of a
session of its own (benches/bench_vs_vllm.py starts r3srv so, as it starts vLLM, so that the
kernel's per-session scheduling groups treat both servers alike), and it still stops cleanly."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from server_fixture import TEST_SERVER_ARGS, RemoteServer


def _autogroup(pid: int) -> str | None:
    """The scheduling group the kernel put `pid` in, where it groups by session (Linux autogroup)."""
    try:
        return Path(f"/proc/{pid}/autogroup").read_text().split()[0]
    except OSError:
        return None


@pytest.mark.slow
def test_own_session_server_leads_its_own_session_and_stops():
    ours = os.getsid(0)
    with RemoteServer("--max-model-len", "24", *TEST_SERVER_ARGS, own_session=True) as srv:
        pid = srv.proc.pid
        assert os.getsid(pid) == pid != ours  # the server is its session's leader, not in ours
        if _autogroup(0) is not None:  # and, where the kernel has autogroups, in another group
            assert _autogroup(pid) != _autogroup(0)
        assert httpx.get(srv.url + "/health", timeout=30).status_code == 200
    assert srv.proc.poll() is not None  # stopped on leaving the block
