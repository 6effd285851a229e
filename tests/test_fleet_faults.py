"""Faults of a 2-replica fleet with requests in flight: a replica killed during a fanned-out
/update_weights_from_disk, a control call that only part of the fleet can apply, a trainer killed
mid-broadcast, the front killed. Every request ends with its tokens and rows or a clean error
(a 503 OpenAI error, or mid-stream an error event then [DONE]); no KV block is left in use; the
replicas end on one weight version (or the fleet's URL names the mix).

The tests share one fleet and run in file order; the last one kills the front.
"""

from __future__ import annotations

import concurrent.futures
import json
import multiprocessing
import os
import signal
import time

import httpx
import pytest
import weight_sync_trainer as trainer
from server_fixture import free_port
from test_fleet import (  # noqa: F401  (policies: the fixture, shared)
    alive, children, counter, get, policies, post, replica_pid, replica_urls, started_fleet, wait_for,
)

from r3srv.serial import decode_routed_experts

MAX_MODEL_LEN, NEW_TOKENS = 512, 400
pytestmark = pytest.mark.slow  # real servers, a trainer process
FLEET_ARGS = ("--data-parallel-size", "2", "--enable-weight-updates", "--enable-return-routed-experts",
              "--device", "cpu", "--num-kv-blocks", "128", "--max-num-seqs", "8", "--max-model-len", str(MAX_MODEL_LEN),
              "--log-level", "warning")


@pytest.fixture(scope="module")
def fleet(policies, gate):
    yield from started_fleet(policies[0], FLEET_ARGS, gate)


@pytest.fixture(scope="module")
def replicas(fleet) -> list[str]:
    return replica_urls(fleet.url)


@pytest.fixture
def pool():
    with concurrent.futures.ThreadPoolExecutor(8) as executor:
        yield executor


def rollout(url: str, i: int, stream: bool) -> str:
    """One long completion; 'ok' once its tokens and rows arrived whole, 'error' for a clean error
    (anything else fails the test)."""
    body = {"prompt": f"request {i} " * 3, "max_tokens": NEW_TOKENS, "ignore_eos": True, "temperature": 0,
            "return_token_ids": True, "stream": stream}
    with httpx.Client(timeout=300) as http, http.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code == 503:  # the replica went away before the first byte of the answer
            r.read()
            assert "failed while serving" in r.json()["error"]["message"]
            return "error"
        if not stream:
            r.read()
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            rows = len(choice["prompt_token_ids"]) + len(choice["token_ids"]) - 1
            assert len(choice["token_ids"]) == NEW_TOKENS
            assert decode_routed_experts(choice["routed_experts"]).shape[0] == rows
            return "ok"
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    if "error" in chunks[-1]:
        assert chunks[-1]["error"]["code"] == 503 and "failed while serving" in chunks[-1]["error"]["message"]
        return "error"
    final = chunks[-1]["choices"][0]
    tokens = [t for c in chunks for t in c["choices"][0]["token_ids"]]
    assert final["finish_reason"] == "length" and len(tokens) == NEW_TOKENS
    prompt = next(c["choices"][0]["prompt_token_ids"] for c in chunks if c["choices"][0].get("prompt_token_ids"))
    assert decode_routed_experts(final["routed_experts"]).shape[0] == len(prompt) + NEW_TOKENS - 1
    return "ok"


def running(url: str) -> float:
    return counter(url, "r3srv_num_requests_running")


def no_leaks(fleet) -> None:
    wait_for(lambda: counter(fleet.url, "r3srv_kv_blocks_used") == 0, 60, lambda: "KV blocks left in use")
    assert running(fleet.url) == 0


def all_up(fleet) -> bool:
    return [s["state"] for s in get(fleet.url + "/server_info")["internal_states"]] == ["up", "up"]


def answers(url: str) -> bool:
    """Whether a replica answers at all (a killed one refuses connections until its restart)."""
    try:
        return httpx.get(url + "/health", timeout=30).status_code == 200
    except httpx.TransportError:
        return False


def test_a_replica_killed_during_a_fanned_out_update(fleet, replicas, policies, pool, gate):
    # each replica takes a few steps, then holds: its requests are in flight when replica 1 dies
    # however fast the machine decodes (unheld, a replica could finish them before the kill)
    with gate.allowing(3):
        requests = [pool.submit(rollout, fleet.url, i, stream=i % 2 == 1) for i in range(4)]
        wait_for(lambda: running(replicas[0]) >= 1 and running(replicas[1]) >= 1, 60,
                 lambda: f"requests never ran on both: running {[running(u) for u in replicas]}, "
                         f"states {get(fleet.url + '/server_info')['internal_states']}\n{fleet.log}")
        # the update waits on each replica for its requests in flight; replica 1 dies meanwhile
        update = pool.submit(post, fleet.url + "/update_weights_from_disk", {"model_path": str(policies[1]),
                                                                             "weight_version": "v1"})
        os.kill(replica_pid(fleet.proc.pid, replicas[1]), signal.SIGKILL)
    outcomes = [r.result(timeout=300) for r in requests]
    assert "ok" in outcomes and "error" in outcomes, outcomes  # replica 0's finished, replica 1's ended cleanly
    answer = update.result(timeout=300)
    message = answer.json()["error"]["message"]
    assert answer.status_code == 502 and f"applied on replica 0 ({replicas[0]})" in message, message
    assert f"replica 1 ({replicas[1]}): unreachable" in message
    assert f"weights each replica serves now: replica 0 ({replicas[0]}): v1; replica 1 ({replicas[1]}): " in message
    # the supervisor restarted replica 1 once the update had ended: on the weights replica 0 took
    # (the supervisor may not have seen the kill yet when the update answers: wait for replica 1 itself)
    wait_for(lambda: answers(replicas[1]) and all_up(fleet), 180, lambda: fleet.log)
    assert get(fleet.url + "/get_weight_version") == {"weight_version": "v1"}
    assert [get(u + "/model_info")["model_path"] for u in replicas] == [str(policies[1])] * 2
    no_leaks(fleet)


def test_a_control_call_part_of_the_fleet_cannot_apply_is_named_and_caught_up(fleet, replicas, pool):
    os.kill(replica_pid(fleet.proc.pid, replicas[1]), signal.SIGKILL)
    wait_for(lambda: get(fleet.url + "/server_info")["internal_states"][1]["state"] != "up", 30, lambda: fleet.log)
    paused = post(fleet.url + "/pause_generation", {"mode": "abort"})
    assert paused.status_code == 502 and f"applied on replica 0 ({replicas[0]})" in paused.json()["error"]["message"]
    # the restarted replica takes the fleet's pause: a request waits on either until /continue_generation
    wait_for(lambda: all_up(fleet), 180, lambda: fleet.log)
    assert [get(u + "/is_paused")["is_paused"] for u in replicas] == [True, True]
    held = [pool.submit(rollout, fleet.url, 10 + i, False) for i in range(2)]
    assert post(fleet.url + "/continue_generation").status_code == 200
    assert [r.result(timeout=300) for r in held] == ["ok", "ok"]
    assert get(fleet.url + "/get_weight_version") == {"weight_version": "v1"}
    no_leaks(fleet)


def test_a_trainer_killed_mid_broadcast_leaves_every_replica_on_the_old_weights(fleet, replicas, policies, pool):
    v0, _ = policies
    requests = [pool.submit(rollout, fleet.url, 20 + i, False) for i in range(2)]
    dying = multiprocessing.get_context("spawn").Process(
        target=trainer.push_then_die, args=(fleet.url, free_port(), v0, 3, 3), daemon=True)
    dying.start()
    dying.join(180)
    assert dying.exitcode == 3
    # every replica notices the dead peer, drops what it received and the group with it
    dropped = trainer.group_dropped(fleet.url)
    assert dropped.status_code == 400 and dropped.json()["error"]["param"] == "group_name", dropped.text
    assert [r.result(timeout=300) for r in requests] == ["ok", "ok"]  # generation went on meanwhile
    assert get(fleet.url + "/get_weight_version") == {"weight_version": "v1"}
    assert [get(u + "/get_weight_version")["weight_version"] for u in replicas] == ["v1", "v1"]
    no_leaks(fleet)


def test_the_front_killed_takes_the_fleet_down_and_ends_requests_at_once(fleet, replicas, pool):
    kids = children(fleet.proc.pid)
    assert len(kids) == 2
    assert post(fleet.url + "/pause_generation", {"mode": "abort"}).status_code == 200  # requests are held
    requests = [pool.submit(rollout, fleet.url, 30 + i, stream=i % 2 == 1) for i in range(2)]
    wait_for(lambda: sum(s["in_flight"] for s in get(fleet.url + "/server_info")["internal_states"]) == 2, 60,
             lambda: "the requests never reached the replicas")
    fleet.proc.send_signal(signal.SIGKILL)
    for request in requests:  # the connection closes: an error at once, never a hang
        with pytest.raises(httpx.HTTPError):
            request.result(timeout=60)
    deadline = time.monotonic() + 60
    while any(alive(pid) for pid in kids):
        assert time.monotonic() < deadline, "replicas outlived their front"
        time.sleep(0.2)
