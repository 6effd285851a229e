"""`r3srv serve --data-parallel-size 2`: two replicas behind the real sglang-router (cache_aware).

One fleet serves the whole module (starting it is the slow part); the tests run in file order
and the last two kill a replica and stop the fleet. Discovery endpoints are checked on the
replicas the router registered, which are plain `r3srv serve` processes.
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
import torch
from server_fixture import RemoteServer, free_port
from tiny_checkpoints import write_tiny_checkpoint

from r3srv.cli import build_parser
from r3srv.data_parallel import replica_argv, replica_devices
from r3srv.engine.multiproc_executor import Rendezvous, rank_device
from r3srv.errors import ConfigError
from r3srv.serial import decode_routed_experts
from r3srv.server.fanout import FANOUT_HEADER

pytestmark = [pytest.mark.slow, pytest.mark.peer]  # real servers; the real sglang-router

pytest.importorskip("sglang_router", reason="the fleet tests need sglang-router (pip install 'r3srv[router]')")

NUM_KV_BLOCKS, BLOCK_SIZE, MAX_NUM_SEQS, MAX_MODEL_LEN = 64, 16, 8, 256
FLEET_ARGS = ("--data-parallel-size", "2", "--enable-weight-updates", "--enable-return-routed-experts",
              "--device", "cpu", "--num-kv-blocks", str(NUM_KV_BLOCKS), "--max-num-seqs", str(MAX_NUM_SEQS),
              "--max-model-len", str(MAX_MODEL_LEN), "--enable-prompt-tokens-details", "--log-level", "warning")


@pytest.fixture(scope="module")
def policies(tmp_path_factory):
    root = tmp_path_factory.mktemp("fleet-policies")
    return write_tiny_checkpoint(root / "v0", "qwen3_moe", seed=0), write_tiny_checkpoint(root / "v1", "qwen3_moe", seed=1)


@pytest.fixture(scope="module")
def fleet(policies):
    srv = RemoteServer(str(policies[0]), *FLEET_ARGS)
    try:
        _wait(lambda: len(healthy_workers(srv)) == 2, 120, lambda: f"router never had 2 healthy workers:\n{srv.log}")
        yield srv
    finally:
        srv.stop()
        os.unlink(srv._log.name)


def _wait(ready, timeout: float, why) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline, why()
        time.sleep(0.3)


def healthy_workers(srv) -> list[str]:
    try:
        workers = httpx.get(srv.url + "/workers", timeout=5).json()["workers"]
    except (httpx.HTTPError, ValueError, KeyError):
        return []
    return sorted(w["url"] for w in workers if w["is_healthy"])


@pytest.fixture(scope="module")
def replicas(fleet) -> list[str]:
    return healthy_workers(fleet)


def get(url: str) -> dict:
    response = httpx.get(url, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def post(url: str, body: dict | None = None, **kwargs) -> httpx.Response:
    return httpx.post(url, json=body or {}, timeout=120, **kwargs)


def counter(url: str, name: str, **labels: str) -> float:
    """One Prometheus sample of a replica's /metrics (0 when absent)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(name) and (not want or "{" + want + "}" in line or want in line):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def complete(base: str, prompt: str, max_tokens: int = 4) -> dict:
    model = get(base + "/v1/models")["data"][0]["id"]  # the router needs it to pick a worker
    response = post(base + "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                                               "ignore_eos": True, "return_token_ids": True})
    assert response.status_code == 200, response.text
    return response.json()


# ------------------------------------------------------------------ discovery and health


def test_the_router_registers_both_replicas_under_the_model_name(fleet, replicas):
    workers = get(fleet.url + "/workers")["workers"]
    assert len(workers) == 2 and len(replicas) == 2
    name = get(replicas[0] + "/v1/models")["data"][0]["id"]
    for w in workers:  # the handshake read /server_info and /model_info: no "unknown" model
        assert w["model_id"] == name
        assert w["metadata"]["model_type"] == "qwen3_moe"
        assert w["metadata"]["architectures"] == '["Qwen3MoeForCausalLM"]'
    assert [m["id"] for m in get(fleet.url + "/v1/models")["data"]] == [name]


def test_server_info_and_model_info(replicas, policies):
    url = replicas[0]
    info = get(url + "/server_info")
    assert info == {**get(url + "/get_server_info"), "internal_states": info["internal_states"]}
    assert info["model_path"] == str(policies[0]) == info["tokenizer_path"]
    assert (info["tp_size"], info["dp_size"], info["pp_size"], info["ep_size"]) == (1, 1, 1, 1)
    assert info["enable_return_routed_experts"] is True and info["enable_memory_saver"] is False  # no flag given
    assert info["context_length"] == MAX_MODEL_LEN and info["page_size"] == BLOCK_SIZE
    assert info["max_total_num_tokens"] == NUM_KV_BLOCKS * BLOCK_SIZE
    assert info["max_running_requests"] == MAX_NUM_SEQS and info["device"] == "cpu"
    model = get(url + "/model_info")
    assert model == get(url + "/get_model_info")
    assert model["model_path"] == str(policies[0]) and model["is_generation"] is True
    assert (model["model_type"], model["architectures"]) == ("qwen3_moe", ["Qwen3MoeForCausalLM"])
    assert model["served_model_name"] == info["served_model_name"] == get(url + "/v1/models")["data"][0]["id"]
    assert model["weight_version"] == info["weight_version"] == get(url + "/get_weight_version")["weight_version"] == "0"


def test_loads_as_sglang_and_the_router_read_them(fleet, replicas):
    body = get(replicas[0] + "/v1/loads")
    (load,) = body["loads"]
    assert load["dp_rank"] == 0 and load["max_total_num_tokens"] == NUM_KV_BLOCKS * BLOCK_SIZE
    assert load["max_running_requests"] == MAX_NUM_SEQS and 0.0 <= load["token_usage"] <= 1.0
    assert get(replicas[0] + "/v1/loads?include=core&dp_rank=0")["loads"][0].keys() == load.keys()
    for query, param in (("include=bogus", "include"), ("dp_rank=1", "dp_rank"), ("format=prometheus", "format")):
        response = httpx.get(replicas[0] + "/v1/loads?" + query)
        assert response.status_code == 400 and response.json()["error"]["param"] == param
    (legacy,) = get(replicas[0] + "/get_load")
    assert legacy["num_tokens"] == get(replicas[0] + "/v1/loads")["loads"][0]["num_used_tokens"]
    loads = get(fleet.url + "/get_loads")["workers"]  # the router's own aggregate, read from /get_load
    assert sorted(w["worker"] for w in loads) == replicas and all(w["load"] >= 0 for w in loads)


def test_health_generate_runs_one_token(replicas):
    url = replicas[0]
    before = counter(url, "r3srv_prefix_cache_queries_total")
    response = httpx.get(url + "/health_generate", timeout=60)
    assert response.status_code == 200, response.text
    assert counter(url, "r3srv_prefix_cache_queries_total") == before + 1  # a one-token prompt went through


# ------------------------------------------------------------------ routing


def test_requests_spread_over_both_replicas(fleet, replicas):
    before = [counter(u, "r3srv_requests_total", route="/v1/completions", status="200") for u in replicas]
    rng = np.random.default_rng(0)
    prompts = [f"{i} " + " ".join(rng.choice(["alpha", "bravo", "delta", "kilo", "lima", "oscar"], size=6))
               for i in range(8)]
    # at once: with no shared prefix, cache_aware sends a request to the replica with fewer in flight
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        list(pool.map(lambda prompt: complete(fleet.url, prompt, max_tokens=8), prompts))
    served = [counter(u, "r3srv_requests_total", route="/v1/completions", status="200") - b
              for u, b in zip(replicas, before)]
    assert sum(served) == 8 and min(served) >= 1, served


def test_a_second_turn_hits_the_prefix_cache_of_the_same_replica(fleet, replicas):
    first = "Turn one of a long conversation about routing experts through a router, " * 2
    one = complete(fleet.url, first, max_tokens=4)
    hits_before = [counter(u, "r3srv_prefix_cache_hits_total") for u in replicas]
    second = first + one["choices"][0]["text"] + " And now the second turn asks a follow-up."
    two = complete(fleet.url, second, max_tokens=4)
    cached = two["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= BLOCK_SIZE * (len(one["choices"][0]["prompt_token_ids"]) // BLOCK_SIZE) > 0
    gained = [counter(u, "r3srv_prefix_cache_hits_total") - b for u, b in zip(replicas, hits_before)]
    assert sorted(gained) == [0, cached]  # one replica served it from its cache


def test_routed_experts_intact_through_the_router(fleet, replicas):
    prompt = "Routed experts must arrive intact through the router."
    routed = complete(fleet.url, prompt, max_tokens=6)["choices"][0]
    for url in replicas:  # each replica alone is a single server with the same weights
        direct = complete(url, prompt, max_tokens=6)["choices"][0]
        assert routed["token_ids"] == direct["token_ids"]
        a, b = decode_routed_experts(routed["routed_experts"]), decode_routed_experts(direct["routed_experts"])
        assert a.shape == b.shape == (len(direct["prompt_token_ids"]) + 6 - 1, a.shape[1], a.shape[2])
        np.testing.assert_array_equal(a, b)


# ------------------------------------------------------------------ control calls


def paused(url: str) -> bool:
    return get(url + "/is_paused")["is_paused"]


def test_control_calls_reach_every_replica(fleet, replicas, policies):
    first, other = replicas
    assert post(first + "/pause_generation", {"mode": "abort"}).status_code == 200
    assert paused(first) and paused(other)
    assert httpx.get(other + "/health_generate", timeout=30).status_code == 503  # paused: no generation
    update = post(first + "/update_weights_from_disk", {"model_path": str(policies[1]), "weight_version": "v1"})
    assert update.status_code == 200, update.text
    for url in replicas:
        assert get(url + "/get_weight_version")["weight_version"] == "v1"
        assert get(url + "/model_info")["model_path"] == str(policies[1])
    assert post(other + "/continue_generation").status_code == 200
    assert not paused(first) and not paused(other)
    # a marked call stays on the replica it was sent to
    post(first + "/pause_generation", {"mode": "abort"}, headers={FANOUT_HEADER: "1"})
    assert paused(first) and not paused(other)
    post(first + "/continue_generation", headers={FANOUT_HEADER: "1"})
    assert post(other + "/abort_request", {"abort_all": True}).status_code == 200
    flushed = post(fleet.url + "/flush_cache").json()  # the router fans /flush_cache out itself
    assert flushed["workers_flushed"] == 2, flushed
    # a bad update is refused by every replica alike, and nothing changes
    bad = post(first + "/update_weights_from_disk", {"model_path": str(policies[1] / "missing")})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "model_path"
    assert all(get(u + "/get_weight_version")["weight_version"] == "v1" for u in replicas)
    routed = complete(fleet.url, "After the update.", max_tokens=2)
    assert routed["choices"][0]["weight_version"] == "v1"


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


def test_a_killed_replica_is_reported_and_restarted_on_the_current_weights(fleet, replicas):
    victim = replicas[1]
    port = victim.rsplit(":", 1)[1]
    (pid,) = [p for p, cmd in children(fleet.proc.pid).items() if f"--port {port} " in cmd + " "]
    os.kill(pid, signal.SIGKILL)
    _wait(lambda: re.search(rf"replica \d \({re.escape(victim)}\) exited with code -9: restarting", fleet.log),
          30, lambda: fleet.log)
    _wait(lambda: alive_health(victim), 120, lambda: fleet.log)
    restarted, sibling = get(victim + "/model_info"), get(replicas[0] + "/model_info")
    # on the weights the fleet serves now, under the name the router knows, not the start-up ones
    assert restarted == sibling and restarted["weight_version"] == "v1", fleet.log
    again, other = complete(victim, "Back again.", max_tokens=4), complete(replicas[0], "Back again.", max_tokens=4)
    assert again["choices"][0]["token_ids"] == other["choices"][0]["token_ids"]
    assert again["choices"][0]["routed_experts"] == other["choices"][0]["routed_experts"]


def alive_health(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_sigterm_stops_the_router_and_every_replica(fleet):
    kids = children(fleet.proc.pid)
    # the router renames itself (setproctitle "sglang::router")
    assert len(kids) == 3 and sum("router" in cmd for cmd in kids.values()) == 1, kids
    assert fleet.stop(signal.SIGTERM) == 0, fleet.final_log
    assert not [pid for pid in kids if alive(pid)]


# ------------------------------------------------------------------ pieces without a fleet


def test_replica_argv_passes_every_flag_on_and_sets_its_own_place():
    parser = build_parser()
    args = parser.parse_args(["serve", "m", "-dp", "2", "--port", "9", "--no-enable-prefix-caching",
                              "--enable-weight-updates", "--max-num-seqs", "4", "--served-model-name", "x"])
    argv = replica_argv(parser, args, model="/new", port=123, device="cuda:1", peers=["http://a", "http://b"],
                        weight_version="v7", served_model_name="x")
    child = parser.parse_args(argv[3:])
    assert (child.model, child.port, child.host, child.device, child.data_parallel_size) == ("/new", 123, "127.0.0.1", "cuda:1", 1)
    assert child.fleet_peer_urls == ["http://a", "http://b"] and child.weight_version == "v7"
    same = ("enable_prefix_caching", "enable_weight_updates", "max_num_seqs", "served_model_name", "log_level", "seed")
    assert {k: getattr(child, k) for k in same} == {k: getattr(args, k) for k in same}


def test_a_peer_that_cannot_be_reached_is_named(policies):
    dead = f"http://127.0.0.1:{free_port()}"
    args = ("--enable-weight-updates", "--device", "cpu", "--num-kv-blocks", "32", "--max-model-len", "128",
            "--log-level", "warning", "--fleet-peer-urls", dead)
    with RemoteServer(str(policies[0]), *args) as srv:
        response = post(srv.url + "/flush_cache")
        assert response.status_code == 502 and dead in response.json()["error"]["message"]
        assert post(srv.url + "/flush_cache", headers={FANOUT_HEADER: "1"}).status_code == 200
        # inference is not fanned out
        assert complete(srv.url, "hello", max_tokens=1)["choices"][0]["text"] is not None


def test_replicas_with_tensor_parallel_ranks_take_consecutive_devices():
    """-dp 2 -tp 2: each replica gets -tp 2 and its first device, its ranks the devices from there on."""
    parser = build_parser()
    args = parser.parse_args(["serve", "m", "-dp", "2", "-tp", "2", "--enable-expert-parallel", "--device", "cpu"])
    assert replica_devices(args.device, 2, args.tensor_parallel_size) == ["cpu", "cpu"]
    child = parser.parse_args(replica_argv(parser, args, model="m", port=1, device="cuda:2", peers=[],
                                           weight_version="v")[3:])
    assert (child.tensor_parallel_size, child.enable_expert_parallel, child.data_parallel_size) == (2, True, 1)
    assert child.master_port == 0  # each replica's ranks meet on a free port of their own
    rendezvous = Rendezvous(world_size=2)
    assert [rank_device(child.device, r, rendezvous) for r in range(2)] == [torch.device("cuda", 2), torch.device("cuda", 3)]
    assert rank_device("cuda", 1, rendezvous) == torch.device("cuda", 1)
    if not torch.cuda.is_available() or torch.cuda.device_count() < 4:
        with pytest.raises(ConfigError, match="needs 4 CUDA devices"):
            replica_devices("cuda", 2, 2)
