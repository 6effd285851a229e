"""POST /update_weights_from_disk and /reset_prefix_cache on a real server (--enable-weight-updates)."""

from __future__ import annotations

import concurrent.futures
import re
import time

import httpx
import numpy as np
import openai
import pytest
from fault_testing import metric
from server_fixture import TEST_SERVER_ARGS, RemoteServer
from tiny_checkpoints import write_tiny_checkpoint

from engine_testing import GREEDY, prompt_ids
from r3srv import LLM, SamplingParams
from r3srv.serial import decode_routed_experts

pytestmark = pytest.mark.slow  # real servers

ENGINE = dict(num_kv_blocks=256, max_num_seqs=16, enable_return_routed_experts=True)


@pytest.fixture(scope="module")
def policies(tmp_path_factory):
    root = tmp_path_factory.mktemp("served-policies")
    return (
        write_tiny_checkpoint(root / "v0", "qwen3_moe", seed=0),
        write_tiny_checkpoint(root / "v1", "qwen3_moe", seed=1),
        write_tiny_checkpoint(root / "wide", "qwen3_moe", seed=1, num_experts=16),
    )


@pytest.fixture(scope="module")
def server(policies, gate):
    with RemoteServer(str(policies[0]), "--enable-weight-updates", "--enable-return-routed-experts", *TEST_SERVER_ARGS,
                      step_gate=gate) as srv:
        yield srv
    assert srv.returncode == 0, srv.log


def served(server, prompt: list[int], stream: bool = False):
    """(token ids, routed experts, weight_version) of a greedy completion."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    kwargs = dict(
        model=client.models.list().data[0].id, prompt=prompt, max_tokens=8, temperature=0.0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    if stream:
        chunks = [c.choices[0] for c in client.completions.create(**kwargs, stream=True) if c.choices]
        assert all("weight_version" not in c.model_extra for c in chunks[:-1])  # only the final chunk names it
        final = chunks[-1]
        ids = [t for c in chunks for t in c.token_ids]
        return ids, decode_routed_experts(final.routed_experts), final.weight_version
    choice = client.completions.create(**kwargs).choices[0]
    return choice.token_ids, decode_routed_experts(choice.routed_experts), choice.weight_version


def model_card(server) -> dict:
    return httpx.get(server.url + "/v1/models").json()["data"][0]


def offline(path, prompt: list[int]):
    out = LLM(str(path), **ENGINE).generate([prompt], SamplingParams(max_tokens=8, **GREEDY))[0].outputs[0]
    return out.token_ids, out.routed_experts


def post(server, path: str, body: dict | None = None) -> httpx.Response:
    return httpx.post(server.url + path, json=body or {}, timeout=120)


def test_update_weights_from_disk_then_serve_the_new_policy(server, policies):
    v0, v1, _ = policies
    first, second, third = prompt_ids(20, base=1), prompt_ids(20, base=2), prompt_ids(20, base=5)
    assert model_card(server)["weight_version"] == "0"  # --weight-version's default
    ids, rows, version = served(server, first)
    want_ids, want_rows = offline(v0, first)
    assert ids == want_ids and np.array_equal(rows, want_rows) and version == "0"

    r = post(server, "/update_weights_from_disk", {"model_path": str(v1), "weight_version": "step-1"})
    assert r.status_code == 200, r.text
    assert r.json()["success"] is True and str(v1) in r.json()["message"] and r.json()["weight_version"] == "step-1"
    assert model_card(server)["weight_version"] == "step-1"

    for prompt, stream in ((second, False), (third, True)):
        ids, rows, version = served(server, prompt, stream)
        want_ids, want_rows = offline(v1, prompt)
        assert ids == want_ids and np.array_equal(rows, want_rows) and version == "step-1"


@pytest.mark.parametrize("which", ["wide", "missing"])
def test_a_bad_checkpoint_is_a_400_naming_model_path(server, policies, tmp_path, which):
    path = policies[2] if which == "wide" else tmp_path / "nowhere"
    r = post(server, "/update_weights_from_disk", {"model_path": str(path)})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "model_path" and str(path) in error["message"]
    if which == "wide":
        assert "num_experts=16 (served: 8)" in error["message"]
    assert httpx.get(server.url + "/health").status_code == 200


def test_reset_prefix_cache(server):
    prompt = prompt_ids(40, base=3)
    served(server, prompt)
    r = post(server, "/reset_prefix_cache")
    assert r.status_code == 200 and r.json()["success"] is True and r.json()["num_blocks_forgotten"] >= 2
    assert post(server, "/reset_prefix_cache").json()["num_blocks_forgotten"] == 0
    served(server, prompt)  # SGLang's name for it, which RL frameworks GET or POST
    assert httpx.get(server.url + "/flush_cache").json()["num_blocks_forgotten"] >= 2
    served(server, prompt)
    assert post(server, "/flush_cache").json()["num_blocks_forgotten"] >= 2


def test_metrics_count_weight_updates_by_outcome(server, policies, tmp_path):
    def count(outcome: str) -> float:
        text = httpx.get(server.url + "/metrics").text
        line = next((x for x in text.splitlines() if x.startswith(f'r3srv_weight_updates_total{{outcome="{outcome}"}}')), None)
        return float(line.split()[-1]) if line else 0.0

    before = {o: count(o) for o in ("loaded", "rejected")}
    assert post(server, "/update_weights_from_disk", {"model_path": str(policies[1])}).status_code == 200
    assert post(server, "/update_weights_from_disk", {"model_path": str(tmp_path)}).status_code == 400
    assert count("loaded") == before["loaded"] + 1 and count("rejected") == before["rejected"] + 1
    assert "r3srv_weight_update_seconds_count" in httpx.get(server.url + "/metrics").text


def released_gauges(server) -> dict[str, float]:
    lines = httpx.get(server.url + "/metrics").text.splitlines()
    found = (re.match(r'r3srv_memory_released\{tag="(\w+)"\} (\S+)', line) for line in lines)
    return {m.group(1): float(m.group(2)) for m in found if m}


def test_release_and_resume_memory_occupation(server):
    """SGLang's endpoints: requests arriving while memory is released wait, then run as before."""
    prompt = prompt_ids(30, base=4)
    want = served(server, prompt)
    r = post(server, "/release_memory_occupation", {"tags": ["kv_cache", "weights"]})
    assert r.status_code == 200 and r.json() == {"success": True, "released": ["kv_cache", "weights"]}
    assert httpx.get(server.url + "/health").status_code == 200
    assert released_gauges(server) == {"kv_cache": 1.0, "weights": 1.0}
    looked_up = metric(server.url, "r3srv_prefix_cache_queries_total")  # grows when the engine schedules a prompt
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(served, server, prompt)
        deadline = time.monotonic() + 60
        while metric(server.url, "r3srv_num_requests_waiting") == 0:  # it arrived
            assert not pending.done() and time.monotonic() < deadline, "the request never reached the engine"
            time.sleep(0.01)
        # a resume runs once no request is in the engine: one let in (by the release, or by the first
        # resume) would have been scheduled before the second resume answers
        r = post(server, "/resume_memory_occupation", {"tags": ["weights"]})
        assert r.status_code == 200 and r.json()["released"] == ["kv_cache"]
        assert post(server, "/resume_memory_occupation", {"tags": ["weights"]}).json()["released"] == ["kv_cache"]
        assert not pending.done() and metric(server.url, "r3srv_prefix_cache_queries_total") == looked_up  # held
        assert metric(server.url, "r3srv_num_requests_waiting") == 1
        assert released_gauges(server) == {"kv_cache": 1.0, "weights": 0.0}
        assert post(server, "/resume_memory_occupation").json() == {"success": True, "released": []}
        assert released_gauges(server) == {"kv_cache": 0.0, "weights": 0.0}
        ids, rows, version = pending.result(timeout=60)
    assert ids == want[0] and np.array_equal(rows, want[1]) and version == want[2]
    r = post(server, "/release_memory_occupation", {"tags": ["vram"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tags" and "vram" in r.json()["error"]["message"]


def test_pause_retract_update_continue_under_a_live_stream(server, policies, gate):
    """An in-flight rollout survives a policy update (SGLang's partial-rollout flow): paused with
    mode=retract it frees its KV, the update runs at once, and after /continue_generation it
    recomputes its tokens on the new weights and goes on; its final chunk names the new
    version and every row is what the new weights compute for its tokens."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    prompt = prompt_ids(40, base=9)
    replies = {}

    def pause_then_update():
        replies["pause"] = post(server, "/pause_generation", {"mode": "retract"})
        replies["is_paused"] = httpx.get(server.url + "/is_paused").json()
        replies["metrics"] = httpx.get(server.url + "/metrics").text
        replies["update"] = post(server, "/update_weights_from_disk",
                                 {"model_path": str(policies[0]), "weight_version": "mid-rollout"})
        replies["continue"] = post(server, "/continue_generation")

    chunks = []
    with gate.allowing(2):  # the prefill and one decode step: the request is running until the gate opens
        stream = client.completions.create(
            model=client.models.list().data[0].id, prompt=prompt, max_tokens=120, temperature=0.0, stream=True,
            extra_body={"return_token_ids": True, "ignore_eos": True})
        for chunk in stream:
            if chunk.choices:
                chunks.append(chunk.choices[0])
            if chunks and not replies:  # running, and held short of its 120 tokens
                pause_then_update()
                gate.open()
    assert replies["pause"].status_code == 200 and replies["pause"].json()["num_retracted"] == 1
    assert replies["is_paused"] == {"is_paused": True, "mode": "retract"}
    assert 'r3srv_generation_paused{mode="retract"} 1.0' in replies["metrics"]
    assert 'r3srv_generation_paused{mode="retract"} 0.0' in httpx.get(server.url + "/metrics").text
    assert replies["update"].status_code == 200 and replies["update"].json()["weight_version"] == "mid-rollout"
    assert replies["continue"].json() == {"success": True, "was_paused": True}
    assert httpx.get(server.url + "/is_paused").json() == {"is_paused": False, "mode": None}
    final = chunks[-1]
    ids = [t for c in chunks for t in c.token_ids]
    assert final.finish_reason == "length" and len(ids) == 120 and final.weight_version == "mid-rollout"
    rows = decode_routed_experts(final.routed_experts)
    cold = LLM(str(policies[0]), **ENGINE).generate(
        [prompt + ids[:-1]], SamplingParams(max_tokens=1, return_routed_experts=True, **GREEDY))[0].outputs[0]
    np.testing.assert_array_equal(rows, cold.routed_experts)
    bad = post(server, "/pause_generation", {"mode": "sideways"})
    assert bad.status_code == 400 and "mode" in bad.json()["error"]["message"]


def test_malformed_body_is_a_400(server):
    r = post(server, "/update_weights_from_disk", {"path": "x"})
    assert r.status_code == 400 and "model_path" in r.json()["error"]["message"]


def test_the_rl_rollout_example_runs_against_the_server(server, policies):
    """examples/rl_rollout.py: multi-turn episodes whose rows add up to one per token, a policy
    update between batches, and each batch's choices naming their weights."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "examples" / "rl_rollout.py"
    done = subprocess.run(
        [sys.executable, str(script), "--base-url", server.url, "--next-checkpoint", str(policies[0])],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    episodes = [line for line in lines if line.startswith("batch ")]
    assert len(episodes) == 4 and "policy update: {'success': True" in done.stdout
    for line in episodes:  # "batch B episode E: N tokens, routed experts (N - 1, 2, 2) uint8, weights [...]"
        tokens, rows = re.search(r": (\d+) tokens, routed experts \((\d+), 2, 2\) uint8", line).groups()
        assert int(rows) == int(tokens) - 1
    assert all(line.endswith("weights ['batch-1']") for line in episodes[2:])
