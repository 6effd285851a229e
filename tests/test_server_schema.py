"""The published OpenAPI schema describes what is served: schemathesis generates requests for every
operation from /schema/openapi.json and checks each answer against it (status, content type, body
schema, headers) and that no request gets a 5xx. Bounded: a few examples per operation, and a
short context so no generated request generates for long."""

from __future__ import annotations

import json
import re

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.checks import not_a_server_error

from server_fixture import TEST_SERVER_ARGS, RemoteServer

pytestmark = pytest.mark.slow  # real servers

EXAMPLES_PER_OPERATION = 12
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          response_headers_conformance]


def test_every_answer_matches_the_published_schema():
    # without --enable-weight-updates: a generated /pause_generation would hold every later request
    with RemoteServer("--enable-return-routed-experts", "--max-model-len", "24", *TEST_SERVER_ARGS) as srv:
        schema = schemathesis.openapi.from_url(srv.url + "/schema/openapi.json")
        failures, operations = {}, 0
        for result in schema.get_all_operations():
            operation = result.ok()
            operations += 1

            @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, derandomize=True, database=None,
                      suppress_health_check=list(HealthCheck))
            @given(case=operation.as_strategy())
            def check(case):
                case.call_and_validate(checks=CHECKS, timeout=120)

            try:
                check()
            except (Exception, BaseExceptionGroup) as exc:  # one operation's failure must not hide another's
                failures[operation.label] = f"{type(exc).__name__}: {exc}"[:3000]
    assert srv.returncode == 0, srv.log
    assert operations >= 18, "every route is in the schema"
    assert not failures, "\n\n".join(f"{label}: {text}" for label, text in failures.items())


# Sized for CI: every operation of both runs visited (its coverage phase's boundary values, then
# a few generated examples each); benches/schema_fuzz.py runs the same for as long as asked,
# positive_data_acceptance included.
DEEP_RUN = ["--max-examples", "5", "--generation-deterministic"]


def test_a_deep_deterministic_fuzz_of_every_route_finds_no_server_error_or_schema_violation(tmp_path):
    from schema_fuzzing import fuzz_every_route

    runs = fuzz_every_route(tmp_path, DEEP_RUN)
    failed = [run.summary for run in runs if run.returncode != 0]
    assert not failed, "\n\n".join(failed)
    for run in runs:
        assert run.published and run.visited == run.published, (run.label, sorted(run.visited ^ run.published))
        generated = re.search(r"(\d+) generated, (\d+) passed", run.output)
        assert generated and int(generated[1]) >= len(run.published) and generated[1] == generated[2], run.summary


# What longer runs found, replayed: each was a 500 (inf/NaN logits reaching the draw; an
# IndexError in SGLang's salts). A tiny repetition penalty is accepted, as vLLM accepts it.
FINDINGS = [
    ("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 3, "repetition_penalty": 1e-108, "temperature": 0.9}),
    ("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 3, "repetition_penalty": 1e-231, "temperature": 0.0}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                              "repetition_penalty": 1.7e308}),
    ("/inference/v1/generate", {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 3,
                                                                            "repetition_penalty": 1e-108}}),
    ("/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 3, "repetition_penalty": 1e-108}}),
    ("/generate", {"text": "hi", "cache_salt": []}),
    ("/generate", {"text": ["a", "b"], "extra_key": ["k"]}),
]


def test_what_longer_fuzz_runs_found_is_answered_without_a_server_error():
    import httpx

    with RemoteServer("--max-model-len", "24", *TEST_SERVER_ARGS) as srv, httpx.Client(base_url=srv.url,
                                                                                    timeout=120) as http:
        for path, body in FINDINGS:
            r = http.post(path, json=body)
            assert r.status_code in (200, 400), (path, body, r.text)
            if r.status_code == 400:
                assert r.json()["error"]["param"] in ("cache_salt", "extra_key"), r.text
    assert srv.returncode == 0, srv.log


def test_the_deep_runs_acceptance_check_passes_only_the_listed_peer_refusals():
    from schema_fuzz_hooks import PEER_REFUSALS, peer_refusal

    def body(message: str) -> bytes:
        error = {"message": message, "type": "BadRequestError", "param": None, "code": 400}
        return json.dumps({"error": error}).encode()

    assert peer_refusal("POST /v1/chat/completions", body("`tools` must not be an empty array"))
    assert peer_refusal("POST /skyrl/v1/generate", body("n: Expected `int`, got `float`"))
    # the same message on another route, another message on the route, or no error body: a failure
    assert not peer_refusal("POST /v1/completions", body("`tools` must not be an empty array"))
    assert not peer_refusal("POST /skyrl/v1/generate", body("token_ids: Expected `int` >= 0"))
    assert not peer_refusal("POST /v1/chat/completions", b"not json")
    assert all(re.fullmatch(r"(GET|POST) /[\w/]+", op) for op, _ in PEER_REFUSALS)
