"""Control calls of the frameworks' control plane through a --data-parallel-size 2 fleet's one
URL: vLLM's /sleep and /wake_up (declared Fleet.EVERY_REPLICA) reach both replicas with one
answer; SGLang's /begin_weight_update and /end_weight_update (Fleet.OWN_RANK) open and close a
session on each replica. Kept small and apart from test_fleet.py."""

from __future__ import annotations

import httpx
import pytest
from server_fixture import RemoteServer
from test_fleet import replica_urls
from tiny_checkpoints import write_tiny_checkpoint

pytestmark = pytest.mark.slow  # real fleets of servers

ARGS = ("--data-parallel-size", "2", "--enable-weight-updates", "--enable-sleep-mode", "--enable-memory-saver",
        "--device", "cpu", "--num-kv-blocks", "32", "--max-num-seqs", "4", "--max-model-len", "128",
        "--log-level", "warning")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    policy = write_tiny_checkpoint(tmp_path_factory.mktemp("fleet-control") / "v0", seed=0)
    with RemoteServer(str(policy), *ARGS) as srv:
        yield srv.url, replica_urls(srv.url)


def sleeping(url: str) -> dict:
    return httpx.get(url + "/is_sleeping", timeout=30).json()


def test_sleep_and_wake_through_the_fleet_reach_both_replicas(fleet):
    url, (first, second) = fleet
    r = httpx.post(url + "/sleep", params={"level": "1"}, timeout=120)
    assert r.status_code == 200 and r.json() == {"status": "sleeping", "level": 1}, r.text
    assert sleeping(first) == sleeping(second) == {"is_sleeping": True}
    info = httpx.get(second + "/server_info", timeout=30).json()
    assert info["internal_states"][0]["memory_released"] == ["kv_cache", "weights"]
    assert info["enable_memory_saver"] is True and info["port"] == int(second.rsplit(":", 1)[1])
    r = httpx.post(url + "/wake_up", timeout=120)
    assert r.status_code == 200 and r.json() == {"status": "awake", "tags": None}, r.text
    assert sleeping(first) == sleeping(second) == {"is_sleeping": False}


def test_a_weight_update_session_opens_and_closes_on_every_replica(fleet):
    url, (first, second) = fleet
    assert httpx.post(url + "/begin_weight_update", json={}, timeout=30).status_code == 200
    assert httpx.post(url + "/end_weight_update", json={}, timeout=30).status_code == 200
    for replica in (first, second):  # both sessions were closed: a second end finds none open
        assert httpx.post(replica + "/end_weight_update", json={}, timeout=30).status_code == 400
