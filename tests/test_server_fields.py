"""No silent field: every request field of the peers' classes is served, without effect, or a 400
naming it, by the table in r3srv.server.fields, checked against a real server.

tests/data/peer_fields.json is what tools/peer_fields.py extracts from vLLM 0.33's and SGLang
0.5.23's own protocol modules. Regenerate it from newer wheels and every field they add fails
`test_every_peer_field_has_one_fate` until the table (or a request Struct) handles it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from r3srv.server.fields import PEER_CLASSES, ROUTE_FIELDS, BodyFields
from server_fixture import TEST_SERVER_ARGS, RemoteServer

# real servers; the peers' request fields (tests/data/peer_fields.json)
pytestmark = [pytest.mark.slow, pytest.mark.peer]

ROOT = Path(__file__).resolve().parents[1]
PEER_FIELDS = json.loads((ROOT / "tests/data/peer_fields.json").read_text())
ROUTES = {"completions": "/v1/completions", "chat": "/v1/chat/completions", "tito": "/inference/v1/generate",
          "sglang": "/generate"}
# The smallest valid body of each route; a field under test is added to it (or to its sampling_params).
BASE = {
    "completions": {"prompt": "hi", "max_tokens": 2},
    "chat": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "tito": {"token_ids": [5, 6], "sampling_params": {"max_tokens": 2}},
    "sglang": {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}},
}
# A valid, non-default value for every field r3srv serves or accepts without effect; a field a
# Struct starts serving needs one here (the test says which).
EXAMPLES = {
    "model": "r3srv-builtin-random-moe", "prompt": "hello", "messages": [{"role": "user", "content": "yo"}],
    "token_ids": [7, 8, 9], "text": "hello", "input_ids": [3, 4], "image_data": [], "content_parts": [], "n": 2, "temperature": 0.5, "top_p": 0.9, "top_k": 5,
    "seed": 7, "stop": ["zz"], "stream": False, "stream_options": None, "user": "u1", "min_tokens": 1,
    "stop_token_ids": [3], "ignore_eos": True, "skip_special_tokens": False, "include_stop_str_in_output": True,
    "request_id": "fields-test", "return_token_ids": True, "routed_experts_prompt_start": 1,
    "return_routed_experts": True, "return_weight_versions": True, "max_tokens": 3, "logprobs": 2, "max_completion_tokens": 3,
    "top_logprobs": None, "add_generation_prompt": False, "include_reasoning": False, "parallel_tool_calls": False,
    "sampling_params": None, "output_mode": "text", "rid": "fields-test-rid", "return_logprob": True,
    "top_logprobs_num": 2, "routed_experts_start_len": 1, "log_metrics": False, "no_logs": True,
    "routing_key": "k", "conversation_id": "c", "custom_labels": {"a": "b"}, "external_trace_header": {"x": "y"},
    "max_new_tokens": 3, "min_new_tokens": 1, "no_stop_trim": True, "sampling_seed": 7,
    # the sampling fields (docs/sampling.md)
    "logit_bias": {"65": 1.5}, "min_p": 0.05, "presence_penalty": 0.5, "frequency_penalty": 0.5,
    "repetition_penalty": 1.1, "prompt_logprobs": 1, "truncate_prompt_tokens": 2, "truncation_side": "left",
    "cache_salt": "fields-salt", "echo": True, "logprob_start_len": 0, "extra_key": "fields-key",
    # detokenizer and chat options RL clients send
    "spaces_between_special_tokens": False, "return_tokens_as_token_ids": True, "add_special_tokens": False,
    "continue_final_message": False, "detokenize": False, "return_text_in_logprobs": True,
    "custom_params": {"return_top_p_token_ids": False},
    # a mask needs SGLang's top_k bound (test_server_sampling_masks), its mode needs the mask
    "return_sampling_mask": False, "sampling_logprobs_mode": None,
    "return_indexer_topk": False,  # true needs a DSA model and the flag (test_server_indexer_topk)
    "lora_path": [None],  # the base model, named per prompt (an adapter needs --enable-lora: test_server_lora)
    # tool calling and reasoning (docs/protocol.md): on a server without parsers, tools are only shown to
    # the model (tool_choice "none"; `_body` adds it)
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    "tool_choice": "none", "reasoning_effort": "low", "chat_template_kwargs": {"enable_thinking": False},
}
PROBE = "r3srv-probe"  # neither null nor any peer default: a refused field set to it is a 400


def _objects() -> list[tuple[str, str | None, str, BodyFields]]:
    out = []
    for (route, nested), key in PEER_CLASSES.items():
        fields = ROUTE_FIELDS[route] if nested is None else ROUTE_FIELDS[route].nested[nested]
        out.append((route, nested, key, fields))
    return out


def _fates(fields: BodyFields, name: str) -> list[str]:
    fates = []
    if name in fields.served:
        fates.append("served")
    if name in fields.without_effect:
        fates.append("without effect")
    if name in fields.refused:
        fates.append("refused")
    return fates


@pytest.mark.parametrize("route, nested, key, fields", _objects(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_peer_field_has_one_fate(route, nested, key, fields):
    missing, ambiguous = [], []
    for name in PEER_FIELDS["classes"][key]["fields"]:
        fates = _fates(fields, name)
        if not fates:
            missing.append(name)
        if len(fates) > 1:
            ambiguous.append((name, fates))
    assert not missing, f"{key} fields neither served nor refused by r3srv.server.fields: {missing}"
    assert not ambiguous, f"{key} fields with more than one fate: {ambiguous}"
    assert not (fields.without_effect & fields.served), "a served field is not 'without effect'"


def test_peer_fields_json_matches_the_wheels(tmp_path):
    source = os.environ.get("R3SRV_PEER_SRC")
    if not source:
        pytest.skip("set R3SRV_PEER_SRC to the unzipped vllm==0.33.0 and sglang==0.5.23 wheels to regenerate")
    out = tmp_path / "peer_fields.json"
    subprocess.run([sys.executable, str(ROOT / "tools/peer_fields.py"), source, "--out", str(out)], check=True)
    assert json.loads(out.read_text()) == PEER_FIELDS, "tests/data/peer_fields.json is stale: rerun tools/peer_fields.py"
    assert PEER_FIELDS["versions"] == {"vllm": "0.33.0", "sglang": "0.5.23"}


@pytest.fixture(scope="module")
def server():
    with RemoteServer("--enable-return-routed-experts", *TEST_SERVER_ARGS) as srv:
        yield srv


def _body(route: str, nested: str | None, name: str, value: object) -> dict:
    body = json.loads(json.dumps(BASE[route]))
    target = body if nested is None else body.setdefault(nested, {})
    if name in ("text", "input_ids", "prompt", "messages", "token_ids"):
        for prompt in ("text", "input_ids", "prompt", "messages", "token_ids"):
            target.pop(prompt, None)
    if name in ("logprobs", "top_logprobs") and route == "chat":
        value = True if name == "logprobs" else 2
        target["logprobs"] = True
    if name == "sampling_params":  # the base's own (without max_tokens, TITO generates to max_model_len)
        value = BASE[route]["sampling_params"]
    if name == "stream_options":
        target["stream"], value = True, {"include_usage": True}
    if name == "tools":
        target["tool_choice"] = "none"
    target[name] = value
    return body


def _refused(fields: BodyFields) -> list[str]:
    return sorted(name for name in fields.refused if fields.refusal(name) is not None)


@pytest.mark.parametrize("route, nested, key, fields", _objects(), ids=lambda v: v if isinstance(v, str) else "")
def test_refused_fields_are_400s_naming_them(server, route, nested, key, fields):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for name in _refused(fields):
            r = http.post(ROUTES[route], json=_body(route, nested, name, PROBE))
            assert r.status_code == 400, f"{key}.{name}: {r.status_code} {r.text[:300]}"
            error = r.json()["error"]
            assert error["param"] == name and name in error["message"], f"{key}.{name}: {error}"
            assert "not supported" in error["message"] or "not part of" in error["message"] or "chosen by" in error["message"]
        # null (where the peer's type takes it), and the peer's own default, mean "not used":
        # accepted (all in one request); a key the peer itself refuses is left out
        usable = [name for name in _refused(fields) if not fields.refused[name].any_value]
        for off in (lambda name: None, lambda name: fields.defaults.get(name)):
            body = json.loads(json.dumps(BASE[route]))
            target = body if nested is None else body.setdefault(nested, {})
            target.update({name: off(name) for name in usable if off(name) is not None or name not in fields.not_null})
            r = http.post(ROUTES[route], json=body)
            assert r.status_code == 200, f"{key}: {r.status_code} {r.text[:300]}"


@pytest.mark.parametrize("route, nested, key, fields", _objects(), ids=lambda v: v if isinstance(v, str) else "")
def test_served_fields_are_accepted(server, route, nested, key, fields):
    peer = set(PEER_FIELDS["classes"][key]["fields"])
    accepted = sorted((fields.served | fields.without_effect) & peer)
    assert not [n for n in accepted if n not in EXAMPLES], "give EXAMPLES a value for each served field"
    with httpx.Client(base_url=server.url, timeout=120) as http:
        for name in accepted:
            r = http.post(ROUTES[route], json=_body(route, nested, name, EXAMPLES[name]))
            assert r.status_code == 200, f"{key}.{name}={EXAMPLES[name]!r}: {r.status_code} {r.text[:300]}"


def test_fields_neither_peer_has_are_ignored(server):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for route in ROUTES:
            body = {**BASE[route], "r3srv_no_such_field": {"x": [1]}}
            r = http.post(ROUTES[route], json=body)
            assert r.status_code == 200, f"{route}: {r.text[:300]}"


@pytest.mark.parametrize("route, body, param", [
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {}}}},
     "response_format"),
    ("chat", {"response_format": {"type": "json_object"}}, "response_format"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("completions", {"use_beam_search": True}, "use_beam_search"),
    ("completions", {"structured_outputs": {"regex": "a+"}}, "structured_outputs"),
    ("sglang", {"lora_path": "adapter"}, "lora_path"),
    ("sglang", {"image_data": "http://x/y.png"}, "image_data"),
    ("sglang", {"custom_logit_processor": "x"}, "custom_logit_processor"),
    ("sglang", {"sampling_params": {"json_schema": "{}", "max_new_tokens": 2}}, "json_schema"),
    ("sglang", {"sampling_params": [{"ebnf": "root ::= 'a'"}]}, "ebnf"),
    ("sglang", {"sampling_params": {"beam_width": 2}}, "beam_width"),
    ("tito", {"sampling_params": {"structured_outputs": {"json": {}}}}, "structured_outputs"),
])
def test_refusals_rl_clients_meet(server, route, body, param):
    """The refusals the issue names, in the shapes clients send them."""
    r = httpx.post(server.url + ROUTES[route], json={**BASE[route], **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_response_format_text_and_lora_adapter_names(server):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   json={**BASE["chat"], "response_format": {"type": "text"}})
    assert r.status_code == 200, r.text
    r = httpx.post(server.url + "/v1/completions", json={**BASE["completions"], "model": "my-lora-adapter"}, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model", r.text  # as vLLM for an unknown adapter
