"""schemathesis's command line against real servers, in two runs that cover every route: every
route of a server started without --enable-weight-updates (its weight routes answer 404), and the
admin routes of one started with it (generation left out: a fuzzed /pause_generation would hold
it), its weight paths and trainer hosts confined so that nothing generated loads or joins
anything. Used by tests/test_server_schema.py (a deterministic run sized for CI) and
benches/schema_fuzz.py (a long one, with the acceptance check of tests/schema_fuzz_hooks.py too)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from pathlib import Path

import httpx

from server_fixture import TEST_SERVER_ARGS, RemoteServer

# 0 server errors, 0 answers outside the published schema (status, content type, body, headers, SSE events)
CHECKS = ("not_a_server_error", "status_code_conformance", "content_type_conformance", "response_schema_conformance",
          "response_headers_conformance")
# besides: a request the schema admits is not refused, unless the peers refuse it too
# (tests/schema_fuzz_hooks.py, which every run loads)
ACCEPTANCE = "positive_data_acceptance_but_peer_refusals"
HOOKS = "schema_fuzz_hooks"
HTTP_METHODS = ("get", "put", "post", "delete", "options", "head", "patch", "trace")  # a path item's other keys are not operations
GENERATION = r"^/(v1/completions|v1/chat/completions|generate|inference/v1/generate|skyrl/v1/generate|health_generate)$"


@dataclass
class FuzzRun:
    label: str
    returncode: int
    output: str
    published: frozenset[str]  # "METHOD /path" of every operation the run was to fuzz (the schema's, less excluded)
    report: Path  # schemathesis's junit report: a test case per operation it fuzzed

    @property
    def visited(self) -> frozenset[str]:
        """The operations the junit report has a test case of."""
        return frozenset(case.get("name", "") for case in ElementTree.parse(self.report).iter("testcase"))

    @property
    def summary(self) -> str:
        tail = self.output[self.output.rfind("=== FAILURES ===") if "=== FAILURES ===" in self.output else -3000:]
        return f"{self.label}: exit {self.returncode}\n{tail[-12000:]}"


def _schemathesis(url: str, budget: list[str], checks: tuple[str, ...], report: Path, extra: list[str]) -> tuple[int, str]:
    command = [str(Path(sys.executable).with_name("schemathesis")), "run", url + "/schema/openapi.json",
               # one worker: CPython 3.11's ast.parse, which hypothesis calls to describe filters, is not
               # safe across threads ("AST constructor recursion depth mismatch" with two)
               "--checks", ",".join(checks), *budget, "--workers", "1", "--phases", "examples,coverage,fuzzing",
               "--request-timeout", "120", "--no-color", "--suppress-health-check", "all",
               "--report", "junit", "--report-junit-path", str(report), *extra]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": HOOKS,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(command, capture_output=True, text=True, cwd=report.parent, env=env)  # its cache stays there
    return done.returncode, done.stdout + done.stderr


def published_operations(url: str, exclude: str | None = None) -> frozenset[str]:
    """"METHOD /path" of every operation of the server's published schema, less paths matching `exclude`."""
    paths = httpx.get(url + "/schema/openapi.json", timeout=60).json()["paths"]
    return frozenset(f"{method.upper()} {path}" for path, item in paths.items() for method in item
                     if method in HTTP_METHODS and (exclude is None or not re.search(exclude, path)))


def fuzz_every_route(workdir: Path, budget: list[str], checks: tuple[str, ...] = CHECKS) -> list[FuzzRun]:
    """The two runs; `budget`: schemathesis's flags for how much (`-n 20 --generation-deterministic`,
    `--max-time 600 --seed 1`)."""
    runs = []
    with RemoteServer("--enable-return-routed-experts", "--max-model-len", "24", *TEST_SERVER_ARGS) as srv:
        published = published_operations(srv.url)
        code, out = _schemathesis(srv.url, budget, checks, workdir / "every-route.xml", [])
        runs.append(FuzzRun("every route, weight updates off", code, out, published, workdir / "every-route.xml"))
    assert srv.returncode == 0, srv.log
    allowed = workdir / "allowed-weights"
    allowed.mkdir(exist_ok=True)
    with RemoteServer("--enable-return-routed-experts", "--enable-weight-updates", "--max-model-len", "24",
                      "--allowed-weight-paths", str(allowed), "--allowed-trainer-hosts", "127.0.0.1",
                      "--weight-sync-timeout", "5", *TEST_SERVER_ARGS) as srv:
        published = published_operations(srv.url, exclude=GENERATION)
        code, out = _schemathesis(srv.url, budget, checks, workdir / "admin-routes.xml",
                                  ["--exclude-path-regex", GENERATION])
        runs.append(FuzzRun("admin routes, weight updates on", code, out, published, workdir / "admin-routes.xml"))
    assert srv.returncode == 0, srv.log
    return runs
