"""`r3srv serve --data-parallel-size 2`: two replicas behind r3srv's own front, on one URL.

One fleet serves the whole module (starting it is the slow part); the tests run in file order
(the weights move from v0 to v1, then to pushed tensors, then back) and the last two kill a
replica and stop the fleet. Each replica is a plain `r3srv serve` whose URL /server_info lists:
the oracle for what the fleet's URL answers is the same request sent to a replica directly.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import weight_sync_trainer as trainer
from server_fixture import RemoteServer, free_port
from test_server_weight_version_spans import NEW, PROMPT, stream_through
from tiny_checkpoints import write_tiny_checkpoint

from r3srv.serial import decode_routed_experts
from r3srv.server.fanout import FANOUT_HEADER

pytestmark = pytest.mark.slow  # real servers

NUM_KV_BLOCKS, BLOCK_SIZE, MAX_NUM_SEQS, MAX_MODEL_LEN = 96, 16, 8, 512
FLEET_ARGS = ("--data-parallel-size", "2", "--enable-weight-updates", "--enable-return-routed-experts",
              "--device", "cpu", "--num-kv-blocks", str(NUM_KV_BLOCKS), "--max-num-seqs", str(MAX_NUM_SEQS),
              "--max-model-len", str(MAX_MODEL_LEN), "--enable-prompt-tokens-details", "--log-level", "warning")


@pytest.fixture(scope="module")
def policies(tmp_path_factory):
    root = tmp_path_factory.mktemp("fleet-policies")
    return write_tiny_checkpoint(root / "v0", "qwen3_moe", seed=0), write_tiny_checkpoint(root / "v1", "qwen3_moe", seed=1)


def started_fleet(policy: Path, args: tuple[str, ...], gate):
    """A fleet serving `policy`, its replicas behind the step gate, stopped (and its log removed)
    when the generator is closed."""
    srv = RemoteServer(str(policy), *args, step_gate=gate)
    try:
        yield srv
    finally:
        srv.stop()
        os.unlink(srv._log.name)


@pytest.fixture(scope="module")
def fleet(policies, gate):
    yield from started_fleet(policies[0], FLEET_ARGS, gate)


def replica_urls(url: str) -> list[str]:
    return [state["url"] for state in get(url + "/server_info")["internal_states"]]


@pytest.fixture(scope="module")
def replicas(fleet) -> list[str]:
    return replica_urls(fleet.url)


def wait_for(ready, timeout: float, why) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline, why()
        time.sleep(0.3)


def get(url: str) -> dict:
    response = httpx.get(url, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def post(url: str, body: dict | None = None, **kwargs) -> httpx.Response:
    return httpx.post(url, json=body or {}, timeout=120, **kwargs)


def counter(url: str, name: str, **labels: str) -> float:
    """One Prometheus sample of /metrics (0 when absent)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(name + ("{" if want else " ")) and (not want or "{" + want + "}" in line):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def complete(base: str, prompt: str | list[int], max_tokens: int = 4, **extra) -> dict:
    model = get(base + "/v1/models")["data"][0]["id"]
    response = post(base + "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                               "temperature": 0.0, "ignore_eos": True, "return_token_ids": True,
                                               **extra})
    assert response.status_code == 200, response.text
    return response.json()


# ------------------------------------------------------------------ discovery


def test_server_info_reports_the_fleet_and_each_replica(fleet, replicas, policies):
    info = get(fleet.url + "/server_info")
    assert info == {**get(fleet.url + "/get_server_info"), "internal_states": info["internal_states"]}
    assert info["dp_size"] == 2 and len(replicas) == 2 and len(set(replicas)) == 2
    assert info["model_path"] == str(policies[0]) and info["weight_version"] == "0"
    for rank, (state, url) in enumerate(zip(info["internal_states"], replicas)):
        own = get(url + "/server_info")  # each replica is a plain server
        assert own["dp_size"] == 1
        assert state["dp_rank"] == rank and state["state"] == "up"
        assert (state["weight_version"], state["model_path"], state["is_paused"]) == ("0", str(policies[0]), False)
        assert {k: state[k] for k in own["internal_states"][0]} == own["internal_states"][0]
    for key in ("max_total_num_tokens", "context_length", "page_size", "served_model_name"):
        assert info[key] == own[key]
    assert get(fleet.url + "/model_info") == get(replicas[0] + "/model_info")
    cards = [get(url + "/v1/models")["data"] for url in (fleet.url, replicas[1])]
    assert [[{k: v for k, v in card.items() if k != "created"} for card in data] for data in cards] == \
        [[{k: v for k, v in card.items() if k != "created"} for card in cards[1]]] * 2
    assert get(fleet.url + "/get_weight_version") == {"weight_version": "0"}


def test_loads_one_per_replica(fleet, replicas):
    body = get(fleet.url + "/v1/loads")
    assert [load["dp_rank"] for load in body["loads"]] == [0, 1] and body["num_accelerators"] == 2
    for load in body["loads"]:
        assert load["max_total_num_tokens"] == NUM_KV_BLOCKS * BLOCK_SIZE and 0.0 <= load["token_usage"] <= 1.0
        assert load.keys() == get(replicas[0] + "/v1/loads")["loads"][0].keys()
    assert [load["dp_rank"] for load in get(fleet.url + "/v1/loads?dp_rank=1&include=core")["loads"]] == [1]
    for query, param in (("dp_rank=2", "dp_rank"), ("dp_rank=x", "dp_rank"), ("include=bogus", "include"),
                         ("format=prometheus", "format")):
        response = httpx.get(fleet.url + "/v1/loads?" + query)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, (query, response.text)
    assert [load["dp_rank"] for load in get(fleet.url + "/get_load")] == [0, 1]


def test_metrics_are_the_replicas_summed_and_health_generates(fleet, replicas):
    assert counter(fleet.url, "r3srv_kv_blocks_total") == 2 * NUM_KV_BLOCKS
    complete(fleet.url, "count these tokens", max_tokens=3)
    total = counter(fleet.url, "r3srv_generation_tokens_total")
    assert total == sum(counter(u, "r3srv_generation_tokens_total") for u in replicas) >= 3
    assert httpx.get(fleet.url + "/health").status_code == 200
    queries = counter(fleet.url, "r3srv_prefix_cache_queries_total")
    assert httpx.get(fleet.url + "/health_generate", timeout=60).status_code == 200
    assert counter(fleet.url, "r3srv_prefix_cache_queries_total") == queries + 1  # one replica ran one prompt


# ------------------------------------------------------------------ generation on every route


def _sglang_rows(meta: dict, layers: int, top_k: int) -> np.ndarray:
    import base64

    return np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype="<i4").reshape(-1, layers, top_k)


def test_routed_experts_and_their_offsets_arrive_intact_on_every_route(fleet, replicas):
    """Token-id prompts shorter than a KV block (no prefix-cache hit changes a rerun's batch shape)."""
    prompt, start, new = list(range(40, 52)), 7, 4
    layout = get(fleet.url + "/v1/models")["data"][0]["routed_experts"]
    layers, top_k = layout["num_layers"], layout["top_k"]
    rows = len(prompt) + new - 1 - start
    model = get(fleet.url + "/v1/models")["data"][0]["id"]
    bodies = {
        "/v1/completions": {"model": model, "prompt": prompt, "max_tokens": new, "temperature": 0, "ignore_eos": True,
                            "return_token_ids": True, "routed_experts_prompt_start": start},
        "/inference/v1/generate": {"token_ids": prompt, "return_token_ids": True, "sampling_params": {
            "max_tokens": new, "temperature": 0, "ignore_eos": True, "routed_experts_prompt_start": start}},
        "/generate": {"input_ids": prompt, "return_routed_experts": True, "routed_experts_start_len": start,
                      "sampling_params": {"max_new_tokens": new, "temperature": 0, "ignore_eos": True}},
    }
    for route, body in bodies.items():
        through = post(fleet.url + route, body)
        assert through.status_code == 200, through.text
        for url in replicas:  # the same request straight to each replica (same weights)
            direct = post(url + route, body).json()
            if route == "/generate":
                assert through.json()["meta_info"]["routed_experts_start_len"] == start
                a, b = _sglang_rows(through.json()["meta_info"], layers, top_k), _sglang_rows(direct["meta_info"], layers, top_k)
                assert through.json()["output_ids"] == direct["output_ids"]
            else:
                choice, other = through.json()["choices"][0], direct["choices"][0]
                assert choice["token_ids"] == other["token_ids"] and len(choice["token_ids"]) == new
                a, b = decode_routed_experts(choice["routed_experts"]), decode_routed_experts(other["routed_experts"])
            assert a.shape == (rows, layers, top_k), route
            np.testing.assert_array_equal(a, b)


def test_a_stream_arrives_while_it_runs_and_a_disconnect_frees_its_blocks(fleet, gate):
    body = {"prompt": "x" * 40, "max_tokens": MAX_MODEL_LEN - 100, "ignore_eos": True, "stream": True}
    with gate.allowing(2), httpx.Client(timeout=60) as http, \
            http.stream("POST", fleet.url + "/v1/completions", json=body) as r:  # in flight until the client goes
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        # the first chunk came while the request still runs: the front does not buffer the stream
        assert counter(fleet.url, "r3srv_num_requests_running") == 1
        assert counter(fleet.url, "r3srv_kv_blocks_used") > 0
        r.close()
        del lines
    wait_for(lambda: counter(fleet.url, "r3srv_kv_blocks_used") == 0, 30, lambda: "a closed stream kept its KV blocks")
    assert counter(fleet.url, "r3srv_num_requests_running") == 0


def test_errors_pass_through_as_one_server_answers_them(fleet, replicas):
    body = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2, "routed_experts_prompt_start": 4}}
    through, direct = post(fleet.url + "/inference/v1/generate", body), post(replicas[0] + "/inference/v1/generate", body)
    assert through.status_code == direct.status_code == 400 and through.json() == direct.json()
    assert httpx.get(fleet.url + "/v1/nothing").status_code == 404
    assert httpx.get(fleet.url + "/v1/completions").status_code == 405
    assert post(fleet.url + "/v1/completions", {"prompt": "x", "max_tokens": "many"}).json()["error"]["param"] == "max_tokens"


# ------------------------------------------------------------------ the policy


def test_requests_spread_over_both_replicas(fleet, replicas):
    before = [counter(u, "r3srv_requests_total", route="/v1/completions", status="200") for u in replicas]
    rng = np.random.default_rng(0)
    prompts = [f"{i} " + " ".join(rng.choice(["alpha", "bravo", "delta", "kilo", "lima", "oscar"], size=6))
               for i in range(8)]
    # at once: with no shared prefix, a request goes to the replica with fewer in flight
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        list(pool.map(lambda prompt: complete(fleet.url, prompt, max_tokens=8), prompts))
    served = [counter(u, "r3srv_requests_total", route="/v1/completions", status="200") - b
              for u, b in zip(replicas, before)]
    assert sum(served) == 8 and min(served) >= 1, served


def test_a_second_turn_hits_the_prefix_cache_of_the_replica_that_served_the_first(fleet, replicas):
    for turn in range(3):  # three conversations: whichever replica each lands on, its next turn follows
        first = f"Conversation {turn} about routing experts through a fleet of replicas, " * 2
        one = complete(fleet.url, first, max_tokens=4)
        hits_before = [counter(u, "r3srv_prefix_cache_hits_total") for u in replicas]
        second = first + one["choices"][0]["text"] + " And now the second turn asks a follow-up."
        two = complete(fleet.url, second, max_tokens=4)
        cached = two["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= BLOCK_SIZE * (len(one["choices"][0]["prompt_token_ids"]) // BLOCK_SIZE) > 0
        gained = [counter(u, "r3srv_prefix_cache_hits_total") - b for u, b in zip(replicas, hits_before)]
        assert sorted(gained) == [0, cached]  # one replica served it from its cache


# ------------------------------------------------------------------ control calls


def paused(url: str) -> bool:
    return get(url + "/is_paused")["is_paused"]


def test_control_calls_through_the_fleets_url_reach_every_replica(fleet, replicas, policies):
    assert post(fleet.url + "/pause_generation", {"mode": "abort"}).status_code == 200
    assert paused(replicas[0]) and paused(replicas[1])
    assert [s["is_paused"] for s in get(fleet.url + "/server_info")["internal_states"]] == [True, True]
    assert httpx.get(fleet.url + "/health_generate", timeout=30).status_code == 503  # paused: no generation
    update = post(fleet.url + "/update_weights_from_disk", {"model_path": str(policies[1]), "weight_version": "v1"})
    assert update.status_code == 200, update.text
    direct = post(replicas[0] + "/update_weights_from_disk", {"model_path": str(policies[1]), "weight_version": "v1"})
    assert update.json().keys() == direct.json().keys() and update.json()["success"] is True  # a replica's answer
    for url in replicas:
        assert get(url + "/get_weight_version")["weight_version"] == "v1"
        assert get(url + "/model_info")["model_path"] == str(policies[1])
    assert post(fleet.url + "/continue_generation").status_code == 200
    assert not paused(replicas[0]) and not paused(replicas[1])
    assert post(fleet.url + "/abort_request", {"abort_all": True}).status_code == 200
    assert post(fleet.url + "/flush_cache").status_code == 200
    # a bad update is refused by every replica alike: their common answer, and nothing changes
    bad = post(fleet.url + "/update_weights_from_disk", {"model_path": str(policies[1] / "missing")})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "model_path"
    assert get(fleet.url + "/get_weight_version") == {"weight_version": "v1"}
    assert complete(fleet.url, "After the update.", max_tokens=2)["choices"][0]["weight_version"] == "v1"


def test_weight_version_spans_of_an_update_in_keep_mode_come_through_the_front(fleet, replicas, policies, gate):
    """A stream held in flight through the fleet's URL, an update under /pause?mode=keep on every
    replica: its final chunk's spans split where the new weights began, and the tokens after the
    split are what a replica on the new weights continues from them."""
    def keep_update():
        for path, body in (("/pause?mode=keep", None), ("/update_weights_from_disk",
                           {"model_path": str(policies[0]), "weight_version": "v0-mid"}), ("/resume", None)):
            assert post(fleet.url + path, body).status_code == 200

    ids, seen, spans, rows_version = stream_through(fleet, "/v1/completions", gate, keep_update)
    split = spans[0]["end"]
    assert spans == [{"version": "v1", "start": 0, "end": split}, {"version": "v0-mid", "start": split, "end": NEW}]
    assert rows_version == "v0-mid" and 0 < seen <= split < NEW and len(ids) == NEW
    for url in replicas:
        assert complete(url, PROMPT + ids[:split], max_tokens=NEW - split)["choices"][0]["token_ids"] == ids[split:]
    assert post(fleet.url + "/update_weights_from_disk", {"model_path": str(policies[1]), "weight_version": "v1"}).status_code == 200


def test_a_replica_on_other_weights_is_named(fleet, replicas, policies):
    """Weights changed on one replica behind the front's back: the fleet's URL says which serves what."""
    post(replicas[1] + "/update_weight_version", {"new_version": "odd"}, headers={FANOUT_HEADER: "1"})
    try:
        mixed = httpx.get(fleet.url + "/get_weight_version")
        assert mixed.status_code == 409
        assert f"replica 0 ({replicas[0]}): v1" in mixed.json()["error"]["message"]
        assert f"replica 1 ({replicas[1]}): odd" in mixed.json()["error"]["message"]
        assert get(fleet.url + "/server_info")["weight_version"] is None
    finally:
        post(replicas[1] + "/update_weight_version", {"new_version": "v1"})
    assert get(fleet.url + "/get_weight_version") == {"weight_version": "v1"}


def test_a_trainer_joins_through_the_fleets_url_with_a_rank_per_replica(fleet, replicas, policies):
    v0, v1 = policies
    before = complete(replicas[0], "Which policy serves?", max_tokens=6)["choices"][0]
    port = free_port()
    small = post(fleet.url + "/init_weights_update_group", dict(
        master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=2, group_name=trainer.GROUP))
    assert small.status_code == 400 and small.json()["error"]["param"] == "world_size"  # refused before anyone waits
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        group = trainer.join(fleet.url, port, pool, world_size=3)  # the replicas join as ranks 1 and 2
        reply = trainer.push(fleet.url, group, trainer.checkpoint_tensors(v0), pool, weight_version="pushed-v0")
        assert reply.status_code == 200, reply.text
        assert post(fleet.url + "/destroy_weights_update_group", {"group_name": trainer.GROUP}).status_code == 200
        trainer.dist.destroy_process_group(group)  # this process's side too: later tests reuse the group's name
    assert get(fleet.url + "/get_weight_version") == {"weight_version": "pushed-v0"}
    after = [complete(url, "Which policy serves?", max_tokens=6)["choices"][0] for url in replicas]
    assert after[0]["token_ids"] == after[1]["token_ids"]
    assert after[0]["routed_experts"] == after[1]["routed_experts"]
    assert (after[0]["token_ids"], after[0]["routed_experts"]) != (before["token_ids"], before["routed_experts"])
    # back to a checkpoint on disk, which a restarted replica can load
    assert post(fleet.url + "/update_weights_from_disk", {"model_path": str(v1), "weight_version": "v1"}).status_code == 200


# ------------------------------------------------------------------ supervision (these two end the fleet)


def children(pid: int) -> dict[int, str]:
    """pid -> command line of each live child process of `pid`."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == pid and fields[0] != "Z":
            found[int(entry.name)] = cmdline
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def replica_pid(front_pid: int, url: str) -> int:
    port = url.rsplit(":", 1)[1]
    (pid,) = [p for p, cmd in children(front_pid).items() if f"--port {port} " in cmd + " "]
    return pid


def healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_killed_replica_is_restarted_on_the_current_weights_while_the_other_serves(fleet, replicas):
    victim = replicas[1]
    os.kill(replica_pid(fleet.proc.pid, victim), signal.SIGKILL)
    wait_for(lambda: re.search(rf"replica 1 \({re.escape(victim)}\) exited with code -9: restarting", fleet.log),
             30, lambda: fleet.log)
    # meanwhile the fleet's URL serves every request on the other replica
    for i in range(3):
        assert complete(fleet.url, f"While one is down {i}", max_tokens=2)["choices"][0]["weight_version"] == "v1"
    wait_for(lambda: healthy(victim), 120, lambda: fleet.log)
    wait_for(lambda: get(fleet.url + "/server_info")["internal_states"][1]["state"] == "up", 30, lambda: fleet.log)
    restarted, sibling = get(victim + "/model_info"), get(replicas[0] + "/model_info")
    assert restarted == sibling and restarted["weight_version"] == "v1", fleet.log
    again, other = complete(victim, "Back again.", max_tokens=4), complete(replicas[0], "Back again.", max_tokens=4)
    assert again["choices"][0]["token_ids"] == other["choices"][0]["token_ids"]
    assert again["choices"][0]["routed_experts"] == other["choices"][0]["routed_experts"]


def test_sigterm_stops_the_front_and_every_replica(fleet):
    kids = children(fleet.proc.pid)
    # each replica is `r3srv.cli serve ...` (`tests/gated_serve.py GATE serve ...` under the step gate)
    replicas = [cmd for cmd in kids.values() if " serve " in cmd]
    assert len(replicas) == 2, "\n".join(kids.values())
    assert fleet.stop(signal.SIGTERM) == 0, fleet.final_log
    assert not [pid for pid in kids if alive(pid)]
