"""A keyed fleet (`r3srv serve --data-parallel-size 2` with an API key and an admin key): the
router asks its clients for the API key, the replicas for theirs, no replica's command line holds
a key, and a control call one replica fans out reaches the other with the admin key (the API key
there is a 403 that changes nothing on either). Then SIGTERM to the supervisor while a fanned-out
weight update waits for a request in flight: the request ends with its tokens, every call gets an
answer, the supervisor exits 0 and leaves no process behind."""

from __future__ import annotations

import re
import signal
import subprocess

import httpx
import pytest
from server_fixture import TEST_SERVER_ARGS, RemoteServer
from fault_testing import InFlight, RawPost, completion, metric, tokens_and_rows, wait_until
from tiny_checkpoints import write_tiny_checkpoint

pytestmark = pytest.mark.slow

API_KEY, ADMIN_KEY = "fleet-inference-key", "fleet-admin-key"


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        try:
            kids = [int(k) for k in open(f"/proc/{parent}/task/{parent}/children").read().split()]
        except OSError:
            continue
        found += kids
        todo += kids
    return found


def command_line(pid: int) -> bytes:
    try:
        return open(f"/proc/{pid}/cmdline", "rb").read()
    except OSError:
        return b""


@pytest.fixture(scope="module")
def policies(tmp_path_factory):
    root = tmp_path_factory.mktemp("fleet-policies")
    return write_tiny_checkpoint(root / "v0", "qwen3_moe", seed=0), write_tiny_checkpoint(root / "v1", "qwen3_moe", seed=1)


def test_a_keyed_fleet_keeps_every_door_shut_and_stops_cleanly_during_an_update(policies):
    v0, v1 = policies
    fleet = RemoteServer(str(v0), "--data-parallel-size", "2", "--enable-weight-updates",
                         "--enable-return-routed-experts", *TEST_SERVER_ARGS, startup_timeout=300,
                         env={"R3SRV_API_KEY": API_KEY, "R3SRV_ADMIN_API_KEY": ADMIN_KEY}, headers=bearer(API_KEY))
    processes: list[int] = []
    try:
        workers = httpx.get(fleet.url + "/workers", headers=bearer(API_KEY), timeout=30).text
        replicas = sorted(set(re.findall(r"http://127\.0\.0\.1:\d+", workers)))
        assert len(replicas) == 2, workers
        first, second = replicas
        processes = descendants(fleet.proc.pid)
        lines = [command_line(pid) for pid in processes]
        assert sum(b"r3srv.cli" in line for line in lines) == 2 and len(processes) >= 3  # replicas, router
        assert not [line for line in lines if ADMIN_KEY.encode() in line], "the admin key is on a command line"
        assert not [line for line in lines if b"r3srv.cli" in line and API_KEY.encode() in line]

        # the router and the replicas ask for the API key; the admin routes for the admin key
        # (sglang-router 0.3.2 takes text prompts naming their model only)
        text = {"model": httpx.get(first + "/v1/models", headers=bearer(API_KEY)).json()["data"][0]["id"],
                "prompt": "hello", "max_tokens": 2}
        assert httpx.post(fleet.url + "/v1/completions", json=text, timeout=120).status_code == 401
        routed = httpx.post(fleet.url + "/v1/completions", json=text, headers=bearer(API_KEY), timeout=120)
        assert routed.status_code == 200 and routed.json()["choices"][0]["finish_reason"], routed.text
        for url in replicas:
            assert completion(url, [1, 2, 3], 2).status_code == 401
            assert httpx.post(url + "/pause_generation", json={"mode": "abort"}, headers=bearer(API_KEY)).status_code == 403
        for url in replicas:
            assert not httpx.get(url + "/is_paused", headers=bearer(ADMIN_KEY)).json()["is_paused"]
        # a control call reaches the other replica with the admin key the first one forwards
        assert httpx.post(first + "/pause_generation", json={"mode": "abort"}, headers=bearer(ADMIN_KEY)).status_code == 200
        assert httpx.get(second + "/is_paused", headers=bearer(ADMIN_KEY)).json()["is_paused"]
        assert httpx.post(second + "/continue_generation", headers=bearer(ADMIN_KEY)).status_code == 200
        for url in replicas:
            assert not httpx.get(url + "/is_paused", headers=bearer(ADMIN_KEY)).json()["is_paused"]

        # SIGTERM to the supervisor while the fanned-out update waits for a request in flight
        long = InFlight(completion, first, [4, 5, 6], 480, **bearer(API_KEY))
        wait_until(lambda: metric(first, "r3srv_num_requests_running") == 1.0, "the request runs")
        update = RawPost(first, "/update_weights_from_disk", {"model_path": str(v1)}, bearer(ADMIN_KEY))
        wait_until(update.taken_in, "the update is in")
        fleet.proc.send_signal(signal.SIGTERM)
        tokens, _, reason = tokens_and_rows(long.result())
        assert reason in ("abort", "length") and tokens
        status, body = update.result()
        assert status in (200, 502, 503), body  # applied, or a replica named as stopping
        assert fleet.proc.wait(timeout=90) == 0
        wait_until(lambda: not [pid for pid in processes if command_line(pid)], "every fleet process is gone", 60)
    finally:
        fleet.stop()
        for pid in processes:
            if command_line(pid):
                subprocess.run(["kill", "-9", str(pid)], check=False)
