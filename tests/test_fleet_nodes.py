"""Two nodes behind an external router, as a multi-node fleet runs: node A is `r3srv serve
--data-parallel-size 2` (its front registered as one worker; --fleet-peer-urls names node B),
node B a plain `r3srv serve`. Each router (sglang-router 0.3.2, vllm-router 0.1.17, both from PyPI)
is checked route by route against a node's own answer to the same request: passed (the same
tokens and rows), dropped (answered, but a field lost: more rows than asked for) or refused.
docs/fleet.md's table says the same. Then a router restart with requests in flight, and keys:
both nodes keyed, each router started with their API key, what each does with Authorization.
"""

from __future__ import annotations

import base64
import concurrent.futures
import signal
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest
from server_fixture import RemoteServer, free_port
from test_fleet import counter, get, post, replica_urls, wait_for

from r3srv.serial import decode_routed_experts

pytest.importorskip("sglang_router", reason="needs sglang-router (pip install 'r3srv[router]')")
pytest.importorskip("vllm_router", reason="needs vllm-router (pip install 'r3srv[router]')")

pytestmark = [pytest.mark.slow, pytest.mark.peer]  # real servers; the peers' own routers

NODE_ARGS = ("--enable-return-routed-experts", "--enable-weight-updates", "--device", "cpu", "--num-kv-blocks", "64",
             "--max-num-seqs", "8", "--max-model-len", "256", "--log-level", "warning")
ROUTERS = {"sglang": "sglang_router.launch_router", "vllm": "vllm_router.launch_router"}
PROMPT, START, NEW = list(range(40, 52)), 7, 3
MODEL = "r3srv-builtin-random-moe"  # what the nodes serve (NODE_ARGS name no checkpoint)


@pytest.fixture(scope="module")
def nodes(gate):  # every engine of both nodes steps behind the gate (open but in the restart test)
    with RemoteServer(*NODE_ARGS, step_gate=gate) as b, \
            RemoteServer("-dp", "2", "--fleet-peer-urls", b.url, *NODE_ARGS, step_gate=gate) as a:
        yield a, b


class Router:
    """`extra`: more router flags (its --api-key); `headers`: what its readiness probe sends."""

    def __init__(self, kind: str, workers: list[str], port: int | None = None, *, policy: str = "cache_aware",
                 extra: tuple[str, ...] = (), headers: dict[str, str] | None = None) -> None:
        self.kind, self.workers, self.port, self.headers = kind, workers, port or free_port(), headers or {}
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [sys.executable, "-m", ROUTERS[kind], "--host", "127.0.0.1", "--port", str(self.port),
                "--worker-urls", *workers, "--policy", policy, "--prometheus-port", str(free_port()), *extra]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(self.ready, 120, lambda: f"{kind}-router never served /v1/models")

    def ready(self) -> bool:
        assert self.proc.poll() is None, f"{self.kind}-router exited with {self.proc.returncode}"
        try:
            return httpx.get(self.url + "/v1/models", headers=self.headers, timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        self.proc.wait(30)


@pytest.fixture(scope="module", params=list(ROUTERS))
def router(request, nodes):
    r = Router(request.param, [n.url for n in nodes])
    yield r
    r.stop()


def _rows(route: str, answer: dict, layout: dict) -> np.ndarray:
    if route == "/generate":
        raw = base64.b64decode(answer["meta_info"]["routed_experts"])
        return np.frombuffer(raw, dtype="<i4").reshape(-1, layout["num_layers"], layout["top_k"])
    return decode_routed_experts(answer["choices"][0]["routed_experts"])


def _bodies(model: str) -> dict[str, tuple[str, dict]]:
    return {
        "completions, text prompt": ("/v1/completions", {"model": model, "prompt": "hello there", "max_tokens": NEW,
                                                         "temperature": 0, "routed_experts_prompt_start": 2}),
        "completions, token ids": ("/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": NEW,
                                                       "temperature": 0, "routed_experts_prompt_start": START}),
        "chat": ("/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "hi"}],
                                          "max_tokens": NEW, "temperature": 0, "routed_experts_prompt_start": 2}),
        "tito": ("/inference/v1/generate", {"token_ids": PROMPT, "sampling_params": {
            "max_tokens": NEW, "temperature": 0, "routed_experts_prompt_start": START}}),
        "sglang generate": ("/generate", {"input_ids": PROMPT, "return_routed_experts": True,
                                          "routed_experts_start_len": START,
                                          "sampling_params": {"max_new_tokens": NEW, "temperature": 0}}),
    }


# What each router does with each generation request (docs/fleet.md, "Between nodes").
FATES = {
    "sglang": {"completions, text prompt": "passed", "completions, token ids": "refused", "chat": "dropped",
               "tito": "refused", "sglang generate": "dropped"},
    "vllm": {"completions, text prompt": "passed", "completions, token ids": "passed", "chat": "passed",
             "tito": "passed", "sglang generate": "dropped"},
}


def fate(through: httpx.Response, direct: httpx.Response, route: str, layout: dict) -> str:
    if through.status_code >= 400:
        return "refused"
    a, b = _rows(route, through.json(), layout), _rows(route, direct.json(), layout)
    if a.shape != b.shape:
        return "dropped"
    np.testing.assert_array_equal(a, b)  # same request, same weights: the same rows
    return "passed"


def test_what_each_router_passes_drops_or_refuses(router, nodes):
    a, b = nodes
    layout = get(b.url + "/v1/models")["data"][0]["routed_experts"]
    model = get(b.url + "/v1/models")["data"][0]["id"]
    seen = {}
    for case, (route, body) in _bodies(model).items():
        through = httpx.post(router.url + route, json=body, timeout=60)
        direct = httpx.post(b.url + route, json=body, timeout=60)
        assert direct.status_code == 200, direct.text
        seen[case] = fate(through, direct, route, layout)
    assert seen == FATES[router.kind]


def test_control_calls_reach_every_node_through_a_front_with_peers(nodes):
    a, b = nodes
    everyone = [*replica_urls(a.url), b.url]
    assert post(a.url + "/pause_generation", {"mode": "abort"}).status_code == 200
    assert [get(u + "/is_paused")["is_paused"] for u in everyone] == [True] * 3
    assert post(a.url + "/continue_generation").status_code == 200
    assert [get(u + "/is_paused")["is_paused"] for u in everyone] == [False] * 3


def _rollout(url: str, i: int) -> int | str:
    try:
        return httpx.post(url + "/inference/v1/generate", timeout=120, json={
            "token_ids": [10 + i] * 8, "sampling_params": {"max_tokens": 200, "ignore_eos": True}}).status_code
    except httpx.HTTPError as exc:
        return type(exc).__name__


def test_a_router_restart_ends_its_requests_and_leaves_the_nodes_clean(nodes, gate):
    a, b = nodes

    def both(name: str) -> float:
        return counter(a.url, name) + counter(b.url, name)

    router = Router("vllm", [a.url, b.url])
    version = get(a.url + "/get_weight_version")
    with concurrent.futures.ThreadPoolExecutor(4) as pool, gate.allowing(0):  # no step until all four are in
        requests = [pool.submit(_rollout, router.url, i) for i in range(4)]
        wait_for(lambda: both("r3srv_num_requests_waiting") == 4, 60, lambda: "the requests never reached the nodes")
        gate.allow(2)  # their prefill and a decode step, then held in flight, short of their 200 tokens
        wait_for(lambda: both("r3srv_num_requests_running") == 4, 60, lambda: "the requests never started")
        assert both("r3srv_kv_blocks_used") > 0
        router.stop(signal.SIGKILL)
        outcomes = [r.result(timeout=120) for r in requests]
        assert all(isinstance(o, str) for o in outcomes), outcomes  # cut off: the connection closed
        for node in (a, b):  # the nodes aborted what the router left behind (still held: no step ends them)
            wait_for(lambda: counter(node.url, "r3srv_kv_blocks_used") == 0, 60, lambda: "KV blocks left in use")
            assert counter(node.url, "r3srv_num_requests_running") == 0
            assert get(node.url + "/get_weight_version") == version
    again = Router("vllm", [a.url, b.url], port=router.port)  # the same URL again
    try:
        assert _rollout(again.url, 9) == 200
    finally:
        again.stop()


# ------------------------------------------------------------------ keys through a router

API_KEY, ADMIN_KEY = "nodes-inference-key", "nodes-admin-key"


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def _keyed_completion(router: Router, headers: dict[str, str], i: int) -> httpx.Response:
    return httpx.post(router.url + "/v1/completions", headers=headers, timeout=60, json={
        "model": MODEL, "prompt": f"prompt number {i} of the keyed rollout", "max_tokens": NEW, "temperature": 0,
        "ignore_eos": True, "routed_experts_prompt_start": 2})


def _tokens(node) -> float:
    return counter(node.url, "r3srv_generation_tokens_total")  # the probes stay open: no key


def _paused(url: str) -> bool:
    answer = httpx.get(url + "/is_paused", headers=bearer(ADMIN_KEY), timeout=30)
    assert answer.status_code == 200, answer.text
    return answer.json()["is_paused"]


def test_keys_through_each_router():
    """Both nodes (a --data-parallel-size 2 fleet and a server) with an API key and an admin key;
    each router started with the API key as its --api-key, as docs/fleet.md says. A request with
    the key gets its tokens and rows on both nodes; one without it (or with a wrong key) is a 401
    and runs nowhere. What each router does with Authorization, as measured here:
    sglang-router checks the client's key against its --api-key itself (a 401 with an empty body,
    the admin key refused too) and sends that key to the workers, its own discovery included;
    vllm-router passes the client's header on generation (the node says 401), and sends its own
    --api-key on the calls it makes itself (a control call reaches a node with the router's API
    key, a 403 there), so vllm-router must never hold the admin key (tested: it then pauses a node
    for a client without any key). Node A's front reaches node B's (--fleet-peer-urls) with the
    admin key on the control calls it forwards."""
    keys = ("--api-key", API_KEY, "--admin-api-key", ADMIN_KEY)
    with RemoteServer(*NODE_ARGS, *keys, headers=bearer(API_KEY)) as b, \
            RemoteServer("-dp", "2", "--fleet-peer-urls", b.url, *NODE_ARGS, *keys, headers=bearer(API_KEY)) as a:
        layout = httpx.get(b.url + "/v1/models", headers=bearer(API_KEY), timeout=30).json()["data"][0]
        for kind in ROUTERS:
            router = Router(kind, [a.url, b.url], policy="round_robin", extra=("--api-key", API_KEY),
                            headers=bearer(API_KEY))
            try:
                before = [_tokens(a), _tokens(b)]
                for i in range(4):  # round robin: both nodes
                    answer = _keyed_completion(router, bearer(API_KEY), i)
                    assert answer.status_code == 200, (kind, answer.text)
                    out = answer.json()
                    rows = decode_routed_experts(out["choices"][0]["routed_experts"])
                    usage = out["usage"]
                    assert usage["completion_tokens"] == NEW
                    assert rows.shape == (usage["prompt_tokens"] + NEW - 1 - 2, layout["routed_experts"]["num_layers"],
                                          layout["routed_experts"]["top_k"])
                served = [_tokens(a), _tokens(b)]
                assert served[0] > before[0] and served[1] > before[1], (kind, before, served)
                total = sum(served)

                for headers in ({}, bearer("wrong-key")):
                    refused = _keyed_completion(router, headers, 0)
                    assert refused.status_code == 401, (kind, refused.text)
                    # sglang-router answers itself (empty body); vllm-router passes the node's answer on
                    assert ("needs an API key" in refused.text) == (kind == "vllm"), (kind, refused.text)
                admin = _keyed_completion(router, bearer(ADMIN_KEY), 0)
                assert admin.status_code == (401 if kind == "sglang" else 200), (kind, admin.text)
                assert _tokens(a) + _tokens(b) == total + (NEW if kind == "vllm" else 0), kind  # refused: ran nowhere

                pause = httpx.post(router.url + "/pause_generation", json={"mode": "abort"}, headers=bearer(ADMIN_KEY),
                                   timeout=30)
                assert pause.status_code == (404 if kind == "sglang" else 403), (kind, pause.text)
                assert not _paused(a.url) and not _paused(b.url)
                if kind == "sglang":  # its own discovery carried its key: it knows the served model
                    models = httpx.get(router.url + "/v1/models", timeout=30).json()["data"]
                    assert [m["id"] for m in models] == [MODEL]
            finally:
                router.stop()

        # node A's front forwards an every-replica call to node B's front with the admin key it holds,
        # once the client's admin key opened it; the API key opens nothing there
        info = httpx.get(a.url + "/server_info", headers=bearer(API_KEY), timeout=30).json()
        everyone = [state["url"] for state in info["internal_states"]] + [b.url]
        for key, status in ((API_KEY, 403), (ADMIN_KEY, 200)):
            answer = httpx.post(a.url + "/pause_generation", json={"mode": "abort"}, headers=bearer(key), timeout=60)
            assert answer.status_code == status, answer.text
            assert [_paused(u) for u in everyone] == [status == 200] * 3
        assert httpx.post(a.url + "/continue_generation", headers=bearer(ADMIN_KEY), timeout=60).status_code == 200
        assert [_paused(u) for u in everyone] == [False] * 3

        # vllm-router holding the admin key sends it on a keyless client's control call
        router = Router("vllm", [a.url, b.url], policy="round_robin", extra=("--api-key", ADMIN_KEY),
                        headers=bearer(API_KEY))
        try:
            assert _keyed_completion(router, {}, 0).status_code == 401  # generation: still the client's header
            assert httpx.post(router.url + "/pause_generation", json={"mode": "abort"}, timeout=30).status_code == 200
            assert _paused(b.url)  # it paused one worker: node B itself, or node A, which forwards to its peer B
        finally:
            router.stop()
            for node in (a, b):
                assert httpx.post(node.url + "/continue_generation", headers=bearer(ADMIN_KEY),
                                  timeout=60).status_code == 200


def test_neither_router_takes_a_node_whose_probes_are_keyed(tmp_path):
    """Neither router sends a key on its /health checks, its --api-key given or not, so nodes
    behind them keep their probes open (docs/security.md). With --protect-probes, sglang-router's
    health check is refused (401) and every request is its 503 no_available_workers; vllm-router
    waits for the node to become healthy and serves nothing (its port stays closed)."""
    keys = ("--api-key", API_KEY, "--admin-api-key", ADMIN_KEY, "--protect-probes")
    with RemoteServer(*NODE_ARGS, *keys, headers=bearer(API_KEY)) as node:
        routers = {}
        for kind in ROUTERS:
            port, log = free_port(), tmp_path / f"{kind}.log"
            argv = [sys.executable, "-m", ROUTERS[kind], "--host", "127.0.0.1", "--port", str(port), "--worker-urls",
                    node.url, "--prometheus-port", str(free_port()), "--api-key", API_KEY]
            routers[kind] = port, log, subprocess.Popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT)
        try:
            port, log, proc = routers["sglang"]
            wait_for(lambda: "401 Unauthorized" in log.read_text(errors="replace") and "/health" in log.read_text(
                errors="replace"), 120, lambda: f"sglang-router's health check was not refused: {log.read_text()[-2000:]}")
            answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", headers=bearer(API_KEY), timeout=30,
                                json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
            assert answer.status_code == 503 and "no_available_workers" in answer.text, answer.text
            port, log, proc = routers["vllm"]
            wait_for(lambda: "to become healthy" in log.read_text(errors="replace"), 120,
                     lambda: f"vllm-router never waited for the node: {log.read_text()[-2000:]}")
            assert proc.poll() is None
            with pytest.raises(httpx.ConnectError):
                httpx.get(f"http://127.0.0.1:{port}/v1/models", headers=bearer(API_KEY), timeout=5)
        finally:
            for _, _, proc in routers.values():
                proc.terminate()
                proc.wait(30)
