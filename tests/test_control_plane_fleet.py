"""A control call through a --data-parallel-size 2 fleet: vLLM's /sleep and /wake_up (declared
Fleet.EVERY_REPLICA) sent to one replica reach both; the process-group and session calls stay
with the replica they were sent to (Fleet.OWN_RANK). Kept small and apart from test_fleet.py so
that it can follow the fleet's front when that changes."""

from __future__ import annotations

import httpx
import pytest
from server_fixture import RemoteServer
from test_fleet import _wait, healthy_workers
from tiny_checkpoints import write_tiny_checkpoint

pytestmark = pytest.mark.slow  # real fleets of servers

pytest.importorskip("sglang_router", reason="the fleet tests need sglang-router (pip install 'r3srv[router]')")

ARGS = ("--data-parallel-size", "2", "--enable-weight-updates", "--enable-sleep-mode", "--enable-memory-saver",
        "--device", "cpu", "--num-kv-blocks", "32", "--max-num-seqs", "4", "--max-model-len", "128",
        "--log-level", "warning")


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    policy = write_tiny_checkpoint(tmp_path_factory.mktemp("fleet-control") / "v0", seed=0)
    with RemoteServer(str(policy), *ARGS) as fleet:
        _wait(lambda: len(healthy_workers(fleet)) == 2, 120, lambda: f"no 2 healthy workers:\n{fleet.log}")
        yield healthy_workers(fleet)


def sleeping(url: str) -> dict:
    return httpx.get(url + "/is_sleeping", timeout=30).json()


def test_sleep_and_wake_sent_to_one_replica_reach_both(replicas):
    first, second = replicas
    r = httpx.post(first + "/sleep", params={"level": "1"}, timeout=120)
    assert r.status_code == 200 and r.json() == {"status": "sleeping", "level": 1}, r.text
    assert sleeping(first) == sleeping(second) == {"is_sleeping": True}
    info = httpx.get(second + "/server_info", timeout=30).json()
    assert info["internal_states"][0]["memory_released"] == ["kv_cache", "weights"]
    assert info["enable_memory_saver"] is True and info["port"] == int(second.rsplit(":", 1)[1])
    r = httpx.post(second + "/wake_up", timeout=120)
    assert r.status_code == 200 and r.json() == {"status": "awake", "tags": None}, r.text
    assert sleeping(first) == sleeping(second) == {"is_sleeping": False}


def test_a_weight_update_session_stays_on_its_replica(replicas):
    first, second = replicas
    assert httpx.post(first + "/begin_weight_update", json={}, timeout=30).status_code == 200
    # the other replica has no session open: its end has nothing to close
    assert httpx.post(second + "/end_weight_update", json={}, timeout=30).status_code == 400
    assert httpx.post(first + "/end_weight_update", json={}, timeout=30).status_code == 200
