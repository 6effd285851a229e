"""The published OpenAPI schema describes what is served: schemathesis generates requests for every
operation from /schema/openapi.json and checks each answer against it (status, content type, body
schema, headers) and that no request gets a 5xx. Bounded: a few examples per operation, and a
short context so no generated request generates for long."""

from __future__ import annotations

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
