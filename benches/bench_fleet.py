"""A fleet's front against today's alternative, same run, same replicas: `pytest benches/bench_fleet.py -s`.

`r3srv serve --data-parallel-size 2` (the built-in model) starts two replicas behind r3srv's own
front; sglang-router 0.3.2 (cache_aware) is started on the same two replicas. Rounds alternate
between the two fronts:

(a) throughput: CONCURRENT text completions of NEW_TOKENS tokens at once, wall time per batch
    (text prompts: sglang-router refuses token-id prompts on /v1/completions);
(b) second-turn prefix-cache hits: CONVERSATIONS two-turn conversations at once, whose second turn
    repeats the first turn's prompt and answer; the share of the second turns' reusable tokens
    (whole KV blocks of the first turn) that came from a replica's cache (usage.cached_tokens).

Printed: the machine, the ratio of medians for (a), each front's hit share for (b).
"""

from __future__ import annotations

import concurrent.futures
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from serial_cases import machine_description  # noqa: E402
from server_fixture import RemoteServer, free_port  # noqa: E402

pytest.importorskip("sglang_router", reason="the comparison runs sglang-router (pip install 'r3srv[router]')")

CONCURRENT, NEW_TOKENS, ROUNDS = 16, 32, 5
CONVERSATIONS, BLOCK_SIZE = 8, 16
ARGS = ("--data-parallel-size", "2", "--device", "cpu", "--enable-return-routed-experts", "--enable-prompt-tokens-details",
        "--num-kv-blocks", "256", "--max-num-seqs", "16", "--block-size", str(BLOCK_SIZE), "--log-level", "warning")


@pytest.fixture(scope="module")
def fronts():
    with RemoteServer(*ARGS) as fleet:
        replicas = [s["url"] for s in httpx.get(fleet.url + "/server_info").json()["internal_states"]]
        port = free_port()
        router = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
             "--worker-urls", *replicas, "--policy", "cache_aware", "--prometheus-port", str(free_port()),
             "--log-level", "warn"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 120
            while True:
                try:
                    if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert router.poll() is None and time.monotonic() < deadline, "sglang-router did not start"
                time.sleep(0.3)
            yield {"r3srv front": fleet.url, "sglang-router": url}
        finally:
            router.terminate()
            router.wait(30)


def _complete(http: httpx.Client, url: str, model: str, prompt: str, max_tokens: int) -> dict:
    r = http.post(url + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                                 "temperature": 0, "ignore_eos": True, "return_token_ids": True})
    assert r.status_code == 200, r.text
    return r.json()


def _batch(url: str, model: str, tag: str) -> float:
    prompts = [f"{tag} request {i}: " + "tell me about experts " * 4 for i in range(CONCURRENT)]
    with httpx.Client(timeout=600) as http, concurrent.futures.ThreadPoolExecutor(CONCURRENT) as pool:
        t0 = time.perf_counter()
        answers = list(pool.map(lambda p: _complete(http, url, model, p, NEW_TOKENS), prompts))
        elapsed = time.perf_counter() - t0
    assert all(len(a["choices"][0]["token_ids"]) == NEW_TOKENS for a in answers)
    return elapsed


def _second_turn_hits(url: str, model: str, tag: str) -> float:
    def conversation(i: int) -> tuple[int, int]:
        with httpx.Client(timeout=600) as http:
            first = f"{tag} conversation {i} about routing replay, " * 4
            one = _complete(http, url, model, first, 8)["choices"][0]
            two = _complete(http, url, model, first + one["text"] + " And then?", 8)
            reusable = BLOCK_SIZE * (len(one["prompt_token_ids"]) // BLOCK_SIZE)
            return two["usage"]["prompt_tokens_details"]["cached_tokens"], reusable

    with concurrent.futures.ThreadPoolExecutor(CONVERSATIONS) as pool:
        results = list(pool.map(conversation, range(CONVERSATIONS)))
    return sum(min(c, r) for c, r in results) / sum(r for _, r in results)


def test_front_vs_sglang_router_throughput_and_second_turn_hits(benchmark, fronts, request):
    print("\nmachine:", machine_description())
    model = httpx.get(fronts["r3srv front"] + "/v1/models").json()["data"][0]["id"]
    rounds = 1 if request.config.getoption("benchmark_disable", default=False) else ROUNDS
    for name, url in fronts.items():  # warm-up
        _batch(url, model, f"warm {name}")
    times: dict[str, list[float]] = {name: [] for name in fronts}
    order = list(fronts.items())
    counter = iter(range(10**6))

    def one_round() -> None:
        order.reverse()  # alternate who goes first
        n = next(counter)
        for name, url in order:
            times[name].append(_batch(url, model, f"round {n} {name}"))

    benchmark.pedantic(one_round, rounds=rounds, iterations=1)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    ratio = med["sglang-router"] / med["r3srv front"]
    hits = {name: _second_turn_hits(url, model, name) for name, url in fronts.items()}
    benchmark.extra_info.update({"throughput_ratio_front_over_router": ratio,
                                 **{f"second_turn_hits_{k}": v for k, v in hits.items()}})
    print(f"(a) {CONCURRENT} x {NEW_TOKENS} tokens: " + ", ".join(f"{k} median {v:.2f} s" for k, v in med.items())
          + f"; throughput r3srv front / sglang-router: {ratio:.3f}")
    print("(b) second-turn tokens served from the prefix cache: "
          + ", ".join(f"{k} {100 * v:.0f}%" for k, v in hits.items()))
    assert hits["r3srv front"] > 0  # a second turn that never hits the cache is a broken policy
