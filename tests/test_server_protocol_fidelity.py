"""Protocol fidelity against a real server: strict types and the client's own field names, responses
keyed as vLLM's, SGLang's /generate as slime, miles and AReaL use it, no 5xx from any request,
deadlines for stalled connections, and a /health that tells the truth when the engine loop dies."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from server_fixture import TEST_SERVER_ARGS, RemoteServer, free_port, serve_command
from step_gate import one_step_per_item

# real servers; the peers' field names and SGLang's /generate as its clients use it
pytestmark = [pytest.mark.slow, pytest.mark.peer]

PEER_FIELDS = json.loads((Path(__file__).parent / "data/peer_fields.json").read_text())["classes"]
VOCAB = 259  # the built-in model's
MAX_MODEL_LEN = 64
MSG = [{"role": "user", "content": "hi"}]
GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def server(gate):
    args = ("--enable-return-routed-experts", "--enable-weight-updates", "--max-model-len", str(MAX_MODEL_LEN),
            "--timeout-headers", "2", "--timeout-body", "2", *TEST_SERVER_ARGS)
    with RemoteServer(*args, step_gate=gate) as srv:
        yield srv
    assert srv.returncode == 0, srv.log


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def statuses(http) -> dict[tuple[str, str], float]:
    out = {}
    for line in http.get("/metrics").text.splitlines():
        if line.startswith("r3srv_requests_total{"):
            labels, value = line.split("} ")
            route = labels.split('route="')[1].split('"')[0]
            status = labels.split('status="')[1].split('"')[0]
            out[(route, status)] = float(value)
    return out


def assert_400(r: httpx.Response, param: str) -> dict:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and param in error["message"], error
    return error


# ---------------------------------------------------------------- 3. types as the peer converts them, the client's names

# vLLM's routes convert as pydantic's lax mode does (tests/test_peer_verdicts.py holds every field to it)
CONVERTED = [
    ("/v1/completions", {"prompt": "x", "max_tokens": "3"}, lambda r: r["usage"]["completion_tokens"] == 3),
    ("/v1/completions", {"prompt": [1, 2.0], "max_tokens": 2, "return_token_ids": "true"},
     lambda r: r["choices"][0]["prompt_token_ids"] == [1, 2]),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "n": 2.0, "temperature": "0.5"}, lambda r: len(r["choices"]) == 2),
    ("/v1/chat/completions", {"messages": MSG, "max_completion_tokens": "3"}, lambda r: r["usage"]["completion_tokens"] == 3),
    ("/inference/v1/generate", {"token_ids": [1, 2.0], "sampling_params": {"max_tokens": "3"}},
     lambda r: len(r["choices"][0]["token_ids"]) == 3),
    ("/detokenize", {"tokens": [1.0]}, lambda r: isinstance(r["prompt"], str)),
]


@pytest.mark.parametrize("route, body, check", CONVERTED)
def test_vllm_routes_convert_as_pydantic(http, route, body, check):
    r = http.post(route, json=body)
    assert r.status_code == 200 and check(r.json()), r.text


# SGLang's /generate types its fields strictly (its JSON contract gate), and pydantic refuses what
# it cannot convert
STRICT = [
    ("/v1/completions", {"prompt": "x", "max_tokens": "1.5"}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "logprobs": "2"}, "logprobs"),
    ("/generate", {"input_ids": [1, 2.0]}, "input_ids"),
    ("/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": "3"}}, "max_new_tokens"),
    ("/generate", {"input_ids": [1], "routed_experts_start_len": 1.0}, "routed_experts_start_len"),
]


@pytest.mark.parametrize("route, body, param", STRICT)
def test_refused_types(http, route, body, param):
    assert_400(http.post(route, json=body), param)


OUT_OF_VOCAB = [
    ("/v1/completions", {"prompt": [1, VOCAB]}, "prompt"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [VOCAB]}, "stop_token_ids"),
    ("/v1/chat/completions", {"messages": MSG, "stop_token_ids": [VOCAB + 5]}, "stop_token_ids"),
    ("/inference/v1/generate", {"token_ids": [1, VOCAB], "sampling_params": {}}, "token_ids"),
    ("/inference/v1/generate", {"token_ids": [1], "sampling_params": {"stop_token_ids": [VOCAB]}}, "stop_token_ids"),
    ("/generate", {"input_ids": [VOCAB]}, "input_ids"),
    ("/generate", {"input_ids": [[1], [2, VOCAB]], "sampling_params": {"max_new_tokens": 2}}, "input_ids"),
    ("/generate", {"input_ids": [1], "sampling_params": {"stop_token_ids": [VOCAB]}}, "stop_token_ids"),
    ("/detokenize", {"tokens": [VOCAB]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
]


@pytest.mark.parametrize("route, body, param", OUT_OF_VOCAB)
def test_token_ids_outside_the_vocabulary(http, route, body, param):
    assert_400(http.post(route, json=body), param)
    assert http.post("/detokenize", json={"tokens": [VOCAB - 1]}).status_code == 200


@pytest.mark.parametrize("seed", [2**63, -(2**63) - 1])
def test_seeds_outside_signed_64_bit(http, seed):
    assert_400(http.post("/v1/completions", json={"prompt": "x", "seed": seed}), "seed")
    assert_400(http.post("/inference/v1/generate", json={"token_ids": [1], "sampling_params": {"seed": seed}}), "seed")
    assert_400(http.post("/generate", json={"input_ids": [1], "sampling_params": {"sampling_seed": seed}}),
               "sampling_seed")
    ok = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "seed": 2**63 - 1})
    assert ok.status_code == 200, ok.text


def test_errors_name_fields_as_the_client_sent_them(http, client):
    too_many = 10 * MAX_MODEL_LEN
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="r3srv-builtin-random-moe", messages=MSG, max_completion_tokens=too_many)
    assert exc.value.param == "max_completion_tokens" and "max_completion_tokens" in exc.value.message
    with pytest.raises(openai.BadRequestError) as exc:  # the prompt of a chat request is its messages
        client.chat.completions.create(model="r3srv-builtin-random-moe", messages=[{"role": "user", "content": "x" * 300}])
    assert exc.value.param == "messages" and "messages" in exc.value.message
    assert_400(http.post("/inference/v1/generate", json={"token_ids": [1] * MAX_MODEL_LEN, "sampling_params": {}}),
               "token_ids")
    assert_400(http.post("/generate", json={"text": "x" * 300}), "text")
    # (max_new_tokens=0 is served: the prompt alone, docs/sampling.md)
    assert_400(http.post("/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -1}}),
               "max_new_tokens")
    assert_400(http.post("/generate", json={"input_ids": [1, 2], "sampling_params": {"min_new_tokens": -1}}),
               "min_new_tokens")
    error = assert_400(http.post("/generate", json={"input_ids": [1, 2], "routed_experts_start_len": 3}),
                       "routed_experts_start_len")
    assert "routed_experts_prompt_start" not in error["message"]
    assert_400(http.post("/generate", json={"input_ids": [1], "sampling_params": {"top_p": 0.0}}), "top_p")


# ---------------------------------------------------------------- 4. responses keyed as vLLM's


def test_responses_carry_every_key_vllm_sends(http, client):
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).json()
    assert set(r) == set(PEER_FIELDS["vllm.CompletionResponse"]["fields"])
    assert set(r["choices"][0]) - {"weight_version"} == set(PEER_FIELDS["vllm.CompletionResponseChoice"]["fields"])
    assert set(r["usage"]) == set(PEER_FIELDS["vllm.UsageInfo"]["fields"])
    assert r["usage"]["prompt_tokens_details"] is None  # only with --enable-prompt-tokens-details, as vLLM
    r = http.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 2}).json()
    assert set(r) == set(PEER_FIELDS["vllm.ChatCompletionResponse"]["fields"])
    assert set(r["choices"][0]) - {"weight_version"} == set(PEER_FIELDS["vllm.ChatCompletionResponseChoice"]["fields"])
    # vLLM leaves tool_calls out of a message without tool calls
    assert set(r["choices"][0]["message"]) == set(PEER_FIELDS["vllm.ChatMessage"]["fields"]) - {"tool_calls"}
    # the openai SDK's objects have the attributes
    completion = client.completions.create(model="r3srv-builtin-random-moe", prompt="hi", max_tokens=2)
    assert completion.choices[0].prompt_logprobs is None and completion.system_fingerprint is None
    chat = client.chat.completions.create(model="r3srv-builtin-random-moe", messages=MSG, max_tokens=2)
    assert chat.choices[0].message.refusal is None and chat.prompt_logprobs is None


@pytest.mark.parametrize("stream", [False, True])
def test_tito_logprob_entries_per_output_mode_as_vllm(http, stream):
    """vLLM 0.33: tokens mode answers GenerateLogProbsContent entries, text mode OpenAI's
    ChatCompletionLogProbsContent (decoded tokens, their bytes), with the same values."""
    body = {"token_ids": list(range(3, 13)), "stream": stream,
            "sampling_params": {"max_tokens": 3, "logprobs": 2, "ignore_eos": True, **GREEDY}}
    by_mode = {}
    for mode in ("tokens", "text"):
        if stream:
            events = sse_events(http, "/inference/v1/generate", {**body, "output_mode": mode})
            entries = [e for ev in events for c in ev["choices"] for e in (c.get("logprobs") or {}).get("content", [])]
        else:
            r = http.post("/inference/v1/generate", json={**body, "output_mode": mode})
            assert r.status_code == 200, r.text
            entries = r.json()["choices"][0]["logprobs"]["content"]
        assert len(entries) == 3
        by_mode[mode] = entries
    fields = {"tokens": "vllm.GenerateLogProbsContent", "text": "vllm.ChatCompletionLogProbsContent"}
    for mode, entries in by_mode.items():
        assert all(set(e) == set(PEER_FIELDS[fields[mode]]["fields"]) for e in entries), (mode, entries[0])
    for tok, txt in zip(by_mode["tokens"], by_mode["text"]):
        assert txt["logprob"] == pytest.approx(tok["logprob"], abs=1e-5)  # the second run may hit the prefix cache
        assert bytes(txt["bytes"]).decode("utf-8", errors="replace") == txt["token"]
        assert [t["logprob"] for t in txt["top_logprobs"]] == pytest.approx([t["logprob"] for t in tok["top_logprobs"]],
                                                                            abs=1e-5)


def test_sglang_clips_max_new_tokens_to_the_context_as_sglang(http):
    prompt = list(range(3, 13))
    r = http.post("/generate", json={"input_ids": prompt, "sampling_params": {"ignore_eos": True, "min_new_tokens": 500,
                                                                              "max_new_tokens": 500, **GREEDY}})
    assert r.status_code == 200, r.text
    assert len(r.json()["output_ids"]) == MAX_MODEL_LEN - len(prompt)


def test_tito_without_max_tokens_generates_to_max_model_len(http):
    prompt = list(range(3, 13))
    r = http.post("/inference/v1/generate",
                  json={"token_ids": prompt, "sampling_params": {"ignore_eos": True, **GREEDY}}).json()
    assert len(r["choices"][0]["token_ids"]) == MAX_MODEL_LEN - len(prompt)
    assert r["choices"][0]["finish_reason"] == "length"


# ---------------------------------------------------------------- 5. SGLang's /generate


def sse_events(http, route, body, gate=None) -> list[dict]:
    """The events of a stream; with a StepGate, one engine step per event read."""
    with gate.allowing(1) if gate else contextlib.nullcontext(), http.stream("POST", route, json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = (line for line in r.iter_lines() if line)
        lines = list(lines if gate is None else one_step_per_item(gate, lines))
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]


def test_sglang_stream_is_cumulative_with_experts_on_the_final_chunk(http, gate):
    body = {"input_ids": [5, 6, 7, 8], "routed_experts_start_len": 2,
            "sampling_params": {"max_new_tokens": 6, "ignore_eos": True, **GREEDY}}
    whole = http.post("/generate", json=body).json()
    chunks = sse_events(http, "/generate", {**body, "stream": True}, gate)  # a chunk per step
    assert len(chunks) == 6
    for before, after in zip(chunks, chunks[1:]):  # SGLang's default stream: each chunk holds all so far
        assert after["text"].startswith(before["text"])
        assert after["output_ids"][: len(before["output_ids"])] == before["output_ids"]
    assert all(c["meta_info"]["routed_experts_start_len"] == 2 for c in chunks)
    assert ["routed_experts" in c["meta_info"] for c in chunks] == [False] * (len(chunks) - 1) + [True]
    last = chunks[-1]
    assert (last["text"], last["output_ids"]) == (whole["text"], whole["output_ids"])
    assert last["meta_info"]["routed_experts"] == whole["meta_info"]["routed_experts"]
    assert last["meta_info"]["finish_reason"] == whole["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    assert whole["meta_info"]["routed_experts_start_len"] == 2


def test_sglang_batch_answers_a_list_like_one_request_per_prompt(http):
    params = {"max_new_tokens": 4, "ignore_eos": True, **GREEDY}
    prompts = [[5, 6, 7], [9, 10], [11]]
    singles = [http.post("/generate", json={"input_ids": p, "sampling_params": params}).json() for p in prompts]
    batch = http.post("/generate", json={"input_ids": prompts, "sampling_params": params}).json()
    assert isinstance(batch, list) and len(batch) == len(prompts)
    for one, single in zip(batch, singles):
        assert one["output_ids"] == single["output_ids"]
        assert one["meta_info"]["routed_experts"] == single["meta_info"]["routed_experts"]
        assert one["meta_info"]["routed_experts_start_len"] == 0
    texts = http.post("/generate", json={"text": ["ab", "cd"], "rid": ["r-a", "r-b"],
                                         "sampling_params": [{**params, "n": 2}, {**params, "n": 2}]}).json()
    assert [t["meta_info"]["id"] for t in texts] == ["r-a-0", "r-a-1", "r-b-0", "r-b-1"]  # prompt-major, as SGLang
    chunks = sse_events(http, "/generate", {"input_ids": prompts, "sampling_params": params, "stream": True})
    finals = {c["index"]: c for c in chunks if c["meta_info"]["finish_reason"] is not None}
    assert sorted(finals) == [0, 1, 2] and [finals[i]["output_ids"] for i in range(3)] == [s["output_ids"] for s in singles]
    raw = np.frombuffer(__import__("base64").b64decode(batch[0]["meta_info"]["routed_experts"]), dtype="<i4")
    assert raw.size % (len(prompts[0]) + 4 - 1) == 0  # every token but the last, as SGLang


# ---------------------------------------------------------------- 6. no 5xx from any request


def post_routes(http) -> list[str]:
    schema = http.get("/schema/openapi.json").json()
    return sorted(path for path, ops in schema["paths"].items() if "post" in ops)


def test_invalid_utf8_bodies_on_every_post_route(http):
    before = statuses(http)
    routes = post_routes(http)
    assert "/v1/completions" in routes and "/generate" in routes
    for route in routes:
        for body in (b'{"prompt": "\xff\xfe"}', b'\xc3\x28', b'{"text": "a\xed\xa0\x80"}'):
            r = http.post(route, content=body, headers={"content-type": "application/json"})
            assert r.status_code < 500, (route, body, r.status_code, r.text)
            if r.status_code >= 400:  # routes without a body ignore it
                assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    after = statuses(http)
    assert not [k for k in after if k[1].startswith("5") and after[k] != before.get(k, 0)]


@pytest.mark.parametrize("body, param", [
    ({"prompt": [[5, 6, 7], []]}, "prompt"),
    ({"prompt": [[5, 6, 7], [5, VOCAB]]}, "prompt"),
    ({"prompt": [[5, 6, 7, 8], [5, 6]], "routed_experts_prompt_start": 3}, "routed_experts_prompt_start"),
    ({"prompt": ["abc", ""]}, "prompt"),
])
def test_one_bad_prompt_of_a_list_is_a_400_and_starts_nothing_for_long(http, body, param):
    before = statuses(http)
    for _ in range(3):  # the engine stays fine
        assert_400(http.post("/v1/completions", json={**body, "max_tokens": 2}), param)
    ok = http.post("/v1/completions", json={"prompt": [[5, 6], [7, 8]], "max_tokens": 2})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 2
    after = statuses(http)
    assert after.get(("/v1/completions", "500"), 0) == before.get(("/v1/completions", "500"), 0)
    deadline = time.monotonic() + 30
    while _kv_blocks_used(http) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _kv_blocks_used(http) == 0


def _kv_blocks_used(http) -> float:
    line = next(line for line in http.get("/metrics").text.splitlines() if line.startswith("r3srv_kv_blocks_used "))
    return float(line.split()[1])


def test_update_weights_from_a_path_the_file_system_refuses(http):
    version = http.get("/v1/models").json()["data"][0]["weight_version"]
    for path in ("/tmp/" + "a" * 5000, "/tmp/x\u0000y", "/nonexistent/r3srv", "/etc/hostname"):
        assert_400(http.post("/update_weights_from_disk", json={"model_path": path}), "model_path")
    assert http.get("/v1/models").json()["data"][0]["weight_version"] == version  # untouched, not "incomplete:"


# ---------------------------------------------------------------- 7. stalled connections


def _connect(server) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.settimeout(60)
    return sock


def test_stalled_connections_are_closed_and_others_served(server, http):
    before = statuses(http)
    silent = _connect(server)
    half_headers = _connect(server)
    half_headers.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: applic")
    half_body = _connect(server)
    half_body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 200\r\n\r\n{\"prompt\": \"a")
    # others are served meanwhile
    assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
    for sock in (silent, half_headers, half_body):
        assert sock.recv(4096) == b"", "the server closes a stalled connection"
        sock.close()
    # a slow but steady body is read to its end
    slow = _connect(server)
    body = json.dumps({"prompt": "hello", "max_tokens": 1}).encode()
    slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body))
    for i in range(0, len(body), 8):
        slow.sendall(body[i:i + 8])
        time.sleep(0.2)
    answer = b"".join(iter(lambda: slow.recv(65536), b""))
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    after = statuses(http)
    # the abandoned upload counts as 499 (nobody received a response), never as a 500
    assert after.get(("/v1/completions", "499"), 0) >= before.get(("/v1/completions", "499"), 0) + 1
    assert not [k for k in after if k[1].startswith("5") and after[k] != before.get(k, 0)]


def test_sigterm_during_an_upload_answers_503_json():
    with RemoteServer(*TEST_SERVER_ARGS) as srv:
        sock = _connect(srv)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"prompt\"")
        assert httpx.get(srv.url + "/health").status_code == 200  # the upload is in
        srv.proc.send_signal(signal.SIGTERM)
        answer = b"".join(iter(lambda: sock.recv(65536), b""))
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503"), answer
        assert json.loads(body)["error"]["code"] == 503
        assert srv.proc.wait(30) == 0


# ---------------------------------------------------------------- 8. health when the engine loop dies

# Serves with the engine's core thread broken when /reset_prefix_cache arrives: AsyncLLM answers a
# command's own error to its caller, so the break is in the thread's dispatch, outside any request,
# which kills the loop (a test-only hook; nothing of it is in r3srv).
_DYING_SERVER = """
import sys
import r3srv.engine.async_llm as async_llm
import r3srv.server.app as app

_control = async_llm.AsyncLLM._control

def broken(self, asked):
    if type(asked.command).__name__ == "ResetPrefixCache":
        raise RuntimeError("test-only: the engine loop breaks")
    return _control(self, asked)

async_llm.AsyncLLM._control = broken  # AsyncLLM's core thread runs it
app.ENGINE_DEATH_EXIT_DELAY_S = 10.0  # long enough for the test to see the 503
from r3srv.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_health_is_503_then_the_server_exits_non_zero_when_the_engine_loop_dies(tmp_path):
    port = free_port()
    log = tmp_path / "serve.log"
    args = serve_command("--host", "127.0.0.1", "--port", str(port), "--enable-weight-updates", *TEST_SERVER_ARGS)
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-c", _DYING_SERVER, *args[3:]], stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        r = httpx.post(url + "/reset_prefix_cache", timeout=60)
        assert r.status_code == 503 and r.json()["error"]["code"] == 503, r.text
        health = httpx.get(url + "/health", timeout=10)
        assert health.status_code == 503 and health.json()["error"]["type"] == "ServiceUnavailableError"
        assert proc.wait(60) == 3, log.read_text()  # cli.EXIT_ENGINE_DIED
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert "test-only: the engine loop breaks" in text and "engine loop has died" in text
