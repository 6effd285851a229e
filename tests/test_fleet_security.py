"""A keyed fleet (`r3srv serve --data-parallel-size 2` with an API key, an admin key and
--protect-probes), through its front: the front asks for the keys a replica asks for (from the
same route declarations), the replicas for theirs, no process's command line holds a key, the
supervisor's own polls carry a key (the replicas' /health needs one, so the fleet would never
start otherwise), and a control call the front fans out reaches every replica (the API key there
is a 403 that changes nothing on either). Then SIGTERM to the supervisor while a fanned-out weight
update waits for a request in flight: the request ends with its tokens, every call gets an
answer, the supervisor exits 0 and leaves no process behind."""

from __future__ import annotations

import signal
import subprocess

import httpx
import pytest
from fault_testing import InFlight, RawPost, accepting, completion, metric, tokens_and_rows, wait_until
from server_fixture import TEST_SERVER_ARGS, RemoteServer
from test_fleet import policies  # noqa: F401  (the fixture, shared)

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


def paused(url: str) -> bool:
    answer = httpx.get(url + "/is_paused", headers=bearer(ADMIN_KEY), timeout=30)
    assert answer.status_code == 200, answer.text
    return answer.json()["is_paused"]


def test_a_keyed_fleet_keeps_every_door_shut_and_stops_cleanly_during_an_update(policies, gate):
    v0, v1 = policies
    fleet = RemoteServer(str(v0), "--data-parallel-size", "2", "--enable-weight-updates", "--protect-probes",
                         "--enable-return-routed-experts", *TEST_SERVER_ARGS, startup_timeout=300, step_gate=gate,
                         env={"R3SRV_API_KEY": API_KEY, "R3SRV_ADMIN_API_KEY": ADMIN_KEY}, headers=bearer(API_KEY))
    processes: list[int] = []
    try:
        info = httpx.get(fleet.url + "/server_info", headers=bearer(API_KEY), timeout=30)
        assert info.status_code == 200, info.text
        replicas = [state["url"] for state in info.json()["internal_states"]]
        assert len(replicas) == 2 and all(state["state"] == "up" for state in info.json()["internal_states"])
        processes = descendants(fleet.proc.pid)
        lines = [command_line(pid) for pid in processes]
        assert sum(b"--weight-version" in line for line in lines) == 2, lines  # the two replicas
        for line in [command_line(fleet.proc.pid), *lines]:
            assert API_KEY.encode() not in line and ADMIN_KEY.encode() not in line, "a key is on a command line"

        # the front asks what one server asks: no key or a wrong one is a 401, the API key on an
        # admin route a 403 that reaches no replica; probes are keyed too (--protect-probes)
        token_ids = {"prompt": [1, 2, 3], "max_tokens": 2}
        for headers in ({}, bearer("wrong-key")):
            refused = httpx.post(fleet.url + "/v1/completions", json=token_ids, headers=headers, timeout=30)
            assert refused.status_code == 401 and refused.headers["www-authenticate"].startswith("Bearer")
            assert refused.json()["error"]["code"] == 401 and API_KEY not in refused.text
            for path in ("/health", "/metrics", "/workers", "/server_info"):  # probes, an undeclared path, discovery
                assert httpx.get(fleet.url + path, headers=headers, timeout=30).status_code == 401, path
        assert httpx.get(fleet.url + "/health", headers=bearer(API_KEY), timeout=30).status_code == 200
        assert httpx.post(fleet.url + "/pause_generation", json={"mode": "abort"}, headers=bearer(API_KEY),
                          timeout=30).status_code == 403
        assert not paused(replicas[0]) and not paused(replicas[1])
        tokens, rows, _ = tokens_and_rows(completion(fleet.url, [1, 2, 3], 2, **bearer(API_KEY)))
        assert len(tokens) == 2 and rows is not None

        # each replica asks for the keys itself (a local user of the host reaches its port)
        for url in replicas:
            assert completion(url, [1, 2, 3], 2).status_code == 401
            assert httpx.get(url + "/health", timeout=30).status_code == 401
            assert httpx.post(url + "/pause_generation", json={"mode": "abort"}, headers=bearer(API_KEY),
                              timeout=30).status_code == 403
        assert not paused(replicas[0]) and not paused(replicas[1])

        # a control call through the front reaches every replica
        assert httpx.post(fleet.url + "/pause_generation", json={"mode": "abort"}, headers=bearer(ADMIN_KEY),
                          timeout=60).status_code == 200
        assert paused(replicas[0]) and paused(replicas[1])
        assert httpx.post(fleet.url + "/continue_generation", headers=bearer(ADMIN_KEY), timeout=60).status_code == 200
        assert not paused(replicas[0]) and not paused(replicas[1])

        # SIGTERM to the supervisor while the fanned-out update waits for a request in flight
        gate.allow(3)  # the prefill and two decode steps: the request stays in flight, however fast the machine
        long = InFlight(completion, fleet.url, [4, 5, 6], 400, **bearer(API_KEY))
        wait_until(lambda: metric(fleet.url, "r3srv_num_requests_running", **bearer(API_KEY)) == 1.0, "the request runs")
        update = RawPost(fleet.url, "/update_weights_from_disk", {"model_path": str(v1)}, bearer(ADMIN_KEY))
        wait_until(update.taken_in, "the update is in")
        fleet.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: not accepting(fleet.url), "the front stops taking connections")
        gate.open()
        tokens, _, reason = tokens_and_rows(long.result())
        assert reason in ("abort", "length") and 0 < len(tokens) <= 400
        status, body = update.result()
        assert status in (200, 502, 503), body  # applied, or the replicas named as stopping
        assert fleet.proc.wait(timeout=90) == 0
        wait_until(lambda: not [pid for pid in processes if command_line(pid)], "every fleet process is gone", 60)
    finally:
        gate.open()
        fleet.stop()
        for pid in processes:
            if command_line(pid):
                subprocess.run(["kill", "-9", str(pid)], check=False)
