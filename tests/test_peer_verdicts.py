"""Differential test: r3srv decides generated bodies as vLLM 0.33's and SGLang 0.5.23's own
request classes do, and converts accepted values the same way.

tests/data/peer_verdicts.json holds the bodies and the peers' verdicts, written once from the
peers' wheels by tools/peer_verdicts.py (pydantic's lax validation of the peer's request class,
its request-building checks; SGLang's strict JSON contract gate on /generate). Here each body
goes through what r3srv's route does before the engine: the body decoder (server/body.py with
the field table) and the request's own preparation (`to_sampling_params`, `prompts`). For a
field r3srv serves, the decision and the converted value must be the peer's; for a field r3srv
refuses, a value that leaves the feature off (null, the peer's default, as the peer converts
it) must pass and any other must be a 400 naming the field. KNOWN_DIFFERENCES lists, with
their reasons, the cases where r3srv decides otherwise on purpose (docs/protocol.md).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
import pytest

from r3srv.engine.input_processor import InputProcessor
from r3srv.errors import InvalidRequestError
from r3srv.server import protocol as p
from r3srv.server.body import decode_body
from r3srv.server.fields import ROUTE_FIELDS, SAMPLING_PARAMS, BodyFields

pytestmark = pytest.mark.peer  # the peers' verdicts, recorded from their own classes


DATA = json.loads((Path(__file__).parent / "data/peer_verdicts.json").read_text())
TARGETS = {"completions": p.CompletionRequest, "chat": p.ChatCompletionRequest, "tito": p.GenerateRequest,
           "sglang": p.SglangGenerateRequest}


# The engine's request checks (prompt length, offsets, logprob counts) on token-id prompts, at
# the sizes the peers' verdicts were taken with; text prompts would need the model's tokenizer.
ENGINE_INPUT = InputProcessor(None, vocab_size=DATA["vocab_size"], max_model_len=DATA["max_model_len"],
                              enable_return_routed_experts=True)


def _prepare(route: str, data: Any) -> None:
    """What the route and the engine's input processor do with the decoded body before the
    engine core sees the request."""
    if route == "completions":
        data.prompts()
        data.to_sampling_params()
    elif route == "chat":
        data.template_messages()
        data.to_sampling_params()
    elif route == "tito":
        ENGINE_INPUT.process("r", list(data.token_ids), data.to_sampling_params())
    else:
        for i, prompt in enumerate(data.prompts()):
            params = data.to_sampling_params(i, DATA["max_model_len"] - len(prompt))
            if not isinstance(prompt, str):
                ENGINE_INPUT.process("r", prompt, params)


def r3srv_verdict(route: str, body: dict[str, Any]) -> tuple[str, Any]:
    """("ok", decoded request) or ("error", the param the 400 names)."""
    data = None
    try:
        data = decode_body(msgspec.json.encode(body), TARGETS[route], ROUTE_FIELDS[route])
        _prepare(route, data)
    except InvalidRequestError as exc:
        names = data.param_names() if data is not None else {}
        return "error", names.get(exc.param, exc.param)
    except Exception as exc:  # the server's 500
        return "crash", repr(exc)
    return "ok", data


def _json(value: Any) -> Any:
    value = msgspec.to_builtins(value)
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, dict):
        return {str(k): _json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json(v) for v in value]
    return value


def _same(a: Any, b: Any) -> bool:
    """JSON equality where a bool is no number."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _body(case: dict[str, Any]) -> dict[str, Any]:
    body = json.loads(json.dumps(DATA["bases"][case["route"]]))
    target = body if case["nested"] is None else body.setdefault(case["nested"], {})
    target[case["field"]] = case["value"]
    return body


def _object(case: dict[str, Any]) -> BodyFields:
    fields = ROUTE_FIELDS[case["route"]]
    return fields if case["nested"] is None else fields.nested[case["nested"]]


def _fate(fields: BodyFields, name: str) -> str:
    if name in fields.served:
        return "served"
    if name in fields.without_effect:
        return "without effect"
    if name in fields.refused:
        return "refused"
    return "unknown"


def _value(data: Any, case: dict[str, Any]) -> Any:
    holder = data if case["nested"] is None else getattr(data, case["nested"])
    return _json(getattr(holder, case["field"]))


def _is_object(data: Any, case: dict[str, Any]) -> bool:
    """A nested object (stream_options, sampling_params): its own fields are probed one by one."""
    holder = data if case["nested"] is None else getattr(data, case["nested"])
    value = getattr(holder, case["field"])
    return isinstance(value, msgspec.Struct) or (isinstance(value, list) and any(isinstance(v, msgspec.Struct) for v in value))


VLLM = ("completions", "chat", "tito")
# Where r3srv decides otherwise than the peer's request classes, on purpose: (routes, nested
# object, field, the probe values) -> why. docs/protocol.md lists them for users.
KNOWN_DIFFERENCES: list[tuple[tuple[str, ...], str | None, str, list[Any], str]] = [
    (VLLM, None, "cache_salt", ["a/b", "model@v1"],
     "vLLM 0.33 refuses '@', '/', '\\' and NUL in a salt, the releases SkyRL pins did not, and SkyRL salts with "
     "'<model name>@<weight version>'; r3srv only hashes the salt"),
    (("completions", "chat"), None, "stream_options", [{"a": 1}, {"5": 1.5}, {"5": "1.5"}],
     "stream_options holding only keys StreamOptions lacks, without stream: vLLM's check reads the raw object, "
     "r3srv drops unknown keys first and sees no option"),
    (("completions",), None, "prompt", [[]],
     "an empty prompt list: vLLM's request class passes it and its renderer has no prompt to render; r3srv "
     "refuses it at once"),
    (("chat",), None, "messages", [[]],
     "no messages: vLLM's request class passes it and its chat template renders nothing; r3srv refuses it"),
    (("tito",), SAMPLING_PARAMS, "seed", [2**63],
     "a seed outside the signed 64-bit range: vLLM's SamplingParams passes it and torch's generator cannot take "
     "it; vLLM's OpenAI routes and r3srv refuse it"),
    (("tito",), SAMPLING_PARAMS, "max_tokens", [2**63],
     "more tokens than the context holds: vLLM's engine stops at max_model_len; r3srv refuses a max_tokens "
     "beyond the room the prompt leaves, naming it"),
    (("sglang",), None, "logprob_start_len", [[1, 2]],
     "a list of logprob_start_len for one prompt: SGLang keeps the list where a number is read later"),
    (("sglang",), None, "top_logprobs_num", [[1, 2], 2**63],
     "a list for one prompt, or a count beyond any vocabulary: SGLang's classes pass them, its scheduler fails "
     "on them; r3srv refuses (at most 20 top logprobs)"),
    (("sglang",), SAMPLING_PARAMS, "n", [0, -1, -2],
     "n below 1: SGLang's classes pass it (no choice would come back); r3srv refuses it"),
    (("sglang",), SAMPLING_PARAMS, "stop", [""],
     "an empty stop string matches everywhere: SGLang would stop after one token, vLLM refuses it, r3srv too"),
    (("sglang",), None, "return_indexer_topk", [True, 1, 1.0, "1", "true", "True", "yes"],
     "asked of a server without --enable-return-indexer-topk (or of a model without an indexer): SGLang has no "
     "capturer and answers without the field; r3srv refuses it, naming the field"),
]

# Refusals the peer makes after its request classes, in its engine; r3srv makes them while
# preparing the request. field -> (where the peer checks, the values it refuses there)
PEER_ENGINE_CHECKS: dict[tuple[str, str], tuple[str, Any]] = {
    ("tito", "routed_experts_prompt_start"): (
        "vllm/v1/engine/input_processor.py: 0 <= routed_experts_prompt_start <= prompt length",
        lambda v: not 0 <= v <= 2),
    ("tito", "logprobs"): (
        "vllm/sampling_params.py _validate_logprobs: at most max_logprobs (20), -1 counting as the vocabulary",
        lambda v: v == -1 or v > 20),
    ("tito", "prompt_logprobs"): (
        "vllm/sampling_params.py _validate_logprobs: at most max_logprobs (20), -1 counting as the vocabulary",
        lambda v: v == -1 or v > 20),
    ("sglang", "routed_experts_start_len"): (
        "sglang/srt/managers/scheduler.py: routed_experts_start_len in [0, prompt length]",
        lambda v: not 0 <= v <= 2),
}


def _known(case: dict[str, Any]) -> str | None:
    for routes, nested, field, values, why in KNOWN_DIFFERENCES:
        if (case["route"] in routes and case["nested"] == nested and case["field"] == field
                and any(_same(case["value"], v) for v in values)):
            return why
    return None


def _peer_value(case: dict[str, Any]) -> Any:
    """The peer's converted value as r3srv holds it: vLLM's SamplingParams stores `stop` as a list
    and r3srv an empty logit_bias as none; SGLang's sampling fields take null as their default."""
    value = case["ok"]
    if case["route"] == "tito" and case["field"] == "stop" and isinstance(value, str):
        return [value]
    if case["route"] == "tito" and case["field"] == "logit_bias" and value == {}:
        return None
    return value


def _default(case: dict[str, Any]) -> Any:
    fields = _object(case)
    return {f.encode_name: f.default for f in msgspec.structs.fields(fields.struct)}.get(case["field"])


def check_case(case: dict[str, Any]) -> str | None:
    """None when r3srv agrees with the peer on this body, else what differs."""
    fields = _object(case)
    fate = _fate(fields, case["field"])
    verdict, result = r3srv_verdict(case["route"], _body(case))
    if verdict == "crash":
        return f"r3srv crashes (a 500): {result}"
    peer_ok = "ok" in case
    if fate == "refused" and peer_ok:
        refusal = fields.refused[case["field"]]
        off = refusal.accepts(case["ok"], fields.defaults.get(case["field"]), lax=False)
        if off != (verdict == "ok"):
            return f"refused field: peer value {case['ok']!r} leaves it {'off' if off else 'on'}, r3srv says {verdict}"
        if verdict == "error" and result != case["field"]:
            return f"the 400 names {result!r}"
        return None
    if "crash" in case:  # the peer's 500: r3srv answers (a 400 or a 200), never a 500
        return None
    engine_check = PEER_ENGINE_CHECKS.get((case["route"], case["field"]))
    if peer_ok and engine_check is not None and isinstance(case["ok"], int) and engine_check[1](case["ok"]):
        peer_ok = False  # the peer refuses it too, later
    if peer_ok != (verdict == "ok"):
        return f"peer {'accepts' if peer_ok else 'refuses'} ({case.get('ok', case.get('error'))!r}), r3srv {verdict} ({result if verdict == 'error' else ''})"
    if peer_ok and fate == "served" and not _is_object(result, case):
        expected = _peer_value(case)
        if expected is None and case["route"] == "sglang" and case["nested"] is not None:
            expected = _default(case)
        if not _same(_value(result, case), expected):
            return f"value: peer {case['ok']!r}, r3srv {_value(result, case)!r}"
    return None


@pytest.mark.parametrize("route", sorted(TARGETS))
def test_r3srv_decides_like_the_peer(route):
    differences = []
    for case in DATA["cases"]:
        if case["route"] != route or _known(case):
            continue
        why = check_case(case)
        if why is not None:
            differences.append(f"{case['nested'] or ''}.{case['field']}={case['value']!r}: {why}")
    assert not differences, f"{len(differences)} differences:\n" + "\n".join(differences)


def test_the_verdicts_cover_every_peer_field_and_both_outcomes():
    """The data probes every field of every peer class with accepted and refused values."""
    peer_fields = json.loads((Path(__file__).parent / "data/peer_fields.json").read_text())["classes"]
    probed = {(c["route"], c["nested"], c["field"]) for c in DATA["cases"]}
    classes = {("completions", None): "vllm.CompletionRequest", ("chat", None): "vllm.ChatCompletionRequest",
               ("tito", None): "vllm.GenerateRequest", ("tito", SAMPLING_PARAMS): "vllm.SamplingParams",
               ("sglang", None): "sglang.GenerateReqInput", ("sglang", SAMPLING_PARAMS): "sglang.SamplingParams"}
    for (route, nested), key in classes.items():
        missing = [f for f in peer_fields[key]["fields"] if (route, nested, f) not in probed]
        assert not missing, f"{key}: {missing} not probed: rerun tools/peer_verdicts.py"
    outcomes = Counter((c["route"], "ok" in c) for c in DATA["cases"])
    assert all(outcomes[(route, ok)] > 100 for route in TARGETS for ok in (True, False)), outcomes


def test_known_differences_still_differ():
    """Each listed difference is still one (a peer or r3srv change that removes it removes the entry)."""
    for case in DATA["cases"]:
        if _known(case):
            assert check_case(case) is not None, f"{case['route']} {case['field']}={case['value']!r} agrees now"


def test_peer_engine_checks_are_exercised():
    """Every engine-level refusal listed is hit by a probe the peer's classes pass."""
    for (route, field), (_, refuses) in PEER_ENGINE_CHECKS.items():
        hits = [c for c in DATA["cases"] if c["route"] == route and c["field"] == field and isinstance(c.get("ok"), int)
                and not isinstance(c["ok"], bool) and refuses(c["ok"])]
        assert hits, (route, field)
