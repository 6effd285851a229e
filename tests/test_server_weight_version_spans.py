"""Weight-version spans on a real server (--enable-weight-updates): every route's final answer
says which weights sampled which output tokens (vLLM's `weight_versions` on /v1 with
`return_weight_versions` and always on /inference/v1/generate, SGLang's
`meta_info["weight_versions"]` on /generate), and `weight_version` names the weights that
computed the rows. A streamed generation is held in flight by the step gate (it cannot finish
before the gate opens), an update arrives under vLLM's /pause?mode=keep, and the spans must
split exactly where the new weights began: the tokens before are the old checkpoint's greedy
picks, the ones after the new checkpoint's greedy continuation (computed cold in process)."""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import pytest
from server_fixture import TEST_SERVER_ARGS, RemoteServer
from tiny_checkpoints import write_tiny_checkpoint

from engine_testing import GREEDY, prompt_ids
from r3srv import LLM, SamplingParams

pytestmark = pytest.mark.slow  # a real server

ENGINE = dict(num_kv_blocks=256, max_num_seqs=16, enable_return_routed_experts=True)
PROMPT = prompt_ids(12, base=4)  # one prefill step
NEW = 24  # tokens per generation: held short of them until the gate opens


@pytest.fixture(scope="module")
def policies(tmp_path_factory):
    root = tmp_path_factory.mktemp("span-policies")
    return write_tiny_checkpoint(root / "a", "qwen3_moe", seed=0), write_tiny_checkpoint(root / "b", "qwen3_moe", seed=1)


@pytest.fixture(scope="module")
def server(policies, gate):
    with RemoteServer(str(policies[0]), "--enable-weight-updates", "--enable-return-routed-experts",
                      "--weight-version", "a0", *TEST_SERVER_ARGS, step_gate=gate) as srv:
        yield srv
    assert srv.returncode == 0, srv.log


def post(server, path: str, body: dict | None = None) -> httpx.Response:
    response = httpx.post(server.url + path, json=body or {}, timeout=120)
    assert response.status_code == 200, response.text
    return response


def greedy(path, prompt: list[int], n: int) -> list[int]:
    """The oracle: `path`'s greedy continuation of `prompt`, cold, in process."""
    return LLM(str(path), **ENGINE).generate([prompt], SamplingParams(max_tokens=n, **GREEDY))[0].outputs[0].token_ids


def model(server) -> str:
    return httpx.get(server.url + "/v1/models").json()["data"][0]["id"]


# Per route: the streamed body, the output tokens so far from a chunk (sofar: the ids before it),
# and from the final chunk its (spans, rows' version).
ROUTES = {
    "/v1/completions": (
        lambda server: {"model": model(server), "prompt": PROMPT, "max_tokens": NEW, "stream": True,
                        "return_token_ids": True, "return_weight_versions": True, **GREEDY},
        lambda chunk, sofar: sofar + chunk["choices"][0]["token_ids"] if chunk["choices"] else sofar,
        lambda chunk: (chunk["choices"][0]["weight_versions"], chunk["choices"][0]["weight_version"]),
    ),
    "/inference/v1/generate": (
        lambda server: {"token_ids": PROMPT, "stream": True, "sampling_params": {"max_tokens": NEW, **GREEDY}},
        lambda chunk, sofar: sofar + chunk["choices"][0]["token_ids"],
        lambda chunk: (chunk["choices"][0]["weight_versions"], chunk["choices"][0]["weight_version"]),
    ),
    "/generate": (
        lambda server: {"input_ids": PROMPT, "stream": True,
                        "sampling_params": {"max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True}},
        lambda chunk, sofar: chunk["output_ids"],  # SGLang's stream: every chunk holds the output so far
        lambda chunk: (chunk["meta_info"]["weight_versions"], chunk["meta_info"]["weight_version"]),
    ),
}


def stream_through(server, route: str, gate, middle) -> tuple[list[int], int, list, str]:
    """Stream `route`'s generation, held by the gate after 3 steps; once its first tokens have
    arrived, run `middle()` and open the gate. Returns (output ids, ids seen before `middle`,
    the final chunk's spans, its rows' version)."""
    body, tokens, final = ROUTES[route]
    ids: list[int] = []
    seen, last = None, None
    with gate.allowing(3), httpx.Client(timeout=120) as http, http.stream("POST", server.url + route, json=body(server)) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            ids = tokens(chunk, ids)
            last = chunk
            if seen is None and ids:  # running, and held short of its NEW tokens
                seen = len(ids)
                middle()
                gate.open()
    spans, version = final(last)
    return ids, seen, spans, version


def test_an_update_under_keep_splits_the_spans_where_the_new_weights_began(server, policies, gate):
    current, other = policies
    version = "a0"
    for n, route in enumerate(ROUTES):
        new_version = f"update-{n}"

        def keep_update():
            post(server, "/pause?mode=keep")
            post(server, "/update_weights_from_disk", {"model_path": str(other), "weight_version": new_version})
            post(server, "/resume")

        ids, seen, spans, rows_version = stream_through(server, route, gate, keep_update)
        assert len(ids) == NEW and rows_version == new_version, route  # rows recomputed on the new weights
        assert len(spans) == 2, (route, spans)
        split = spans[0]["end"]
        assert spans == [{"version": version, "start": 0, "end": split},
                         {"version": new_version, "start": split, "end": NEW}], route
        # the update came after the tokens streamed before it (and perhaps a step already queued)
        assert seen <= split < NEW, route
        assert ids[:split] == greedy(current, PROMPT, split), route
        assert ids[split:] == greedy(other, PROMPT + ids[:split], NEW - split), route
        current, other, version = other, current, new_version


def test_abort_and_wait_modes_give_one_span(server, gate):
    version = httpx.get(server.url + "/get_weight_version").json()["weight_version"]

    def abort():
        post(server, "/pause?mode=abort")
        post(server, "/resume")

    ids, seen, spans, rows_version = stream_through(server, "/inference/v1/generate", gate, abort)
    assert 0 < seen <= len(ids) < NEW
    assert spans == [{"version": version, "start": 0, "end": len(ids)}] and rows_version == version

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pausing = []

        def wait():  # vLLM's wait mode pauses once the request has finished: not before the gate opens
            pausing.append(pool.submit(post, server, "/pause?mode=wait"))

        ids, _, spans, rows_version = stream_through(server, "/generate", gate, wait)
        pausing[0].result()
    post(server, "/resume")
    assert len(ids) == NEW and spans == [{"version": version, "start": 0, "end": NEW}] and rows_version == version


def test_the_fields_on_each_route_without_an_update(server):
    """Non-streamed answers: vLLM's /v1 routes send weight_versions only when asked (null
    otherwise), /inference/v1/generate, SGLang's /generate and the chat route's SGLang meta_info
    always."""
    version = httpx.get(server.url + "/get_weight_version").json()["weight_version"]
    one = [{"version": version, "start": 0, "end": 5}]
    base = {"model": model(server), "max_tokens": 5, **GREEDY}
    asked = post(server, "/v1/completions", {**base, "prompt": PROMPT, "return_weight_versions": True}).json()
    unasked = post(server, "/v1/completions", {**base, "prompt": PROMPT}).json()
    chat = post(server, "/v1/chat/completions", {**base, "messages": [{"role": "user", "content": "hi"}],
                                                 "return_weight_versions": "true"}).json()  # pydantic's lax bool
    miles = post(server, "/v1/chat/completions", {**base, "messages": [{"role": "user", "content": "hi"}],
                                                  "return_meta_info": True}).json()  # SGLang's chat extension
    tito = post(server, "/inference/v1/generate", {"token_ids": PROMPT, "sampling_params": {"max_tokens": 5, **GREEDY}})
    sglang = post(server, "/generate", {"input_ids": PROMPT, "sampling_params": {
        "max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True}})
    assert asked["choices"][0]["weight_versions"] == one and unasked["choices"][0]["weight_versions"] is None
    assert chat["choices"][0]["weight_versions"] == one
    assert miles["choices"][0]["meta_info"]["weight_versions"] == one and miles["choices"][0]["weight_versions"] is None
    assert tito.json()["choices"][0]["weight_versions"] == one
    assert sglang.json()["meta_info"]["weight_versions"] == one
