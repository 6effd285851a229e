"""Keys as r3srv checks them (server/auth.py) and its security flags (r3srv/security.py), without a
server: the decision for every key configuration, route access and presented key; the ASGI layer
answering before the body is read; keys never in a repr or an error; the flags' combinations.
tests/test_security.py holds the same rules against real servers."""

from __future__ import annotations

import asyncio
import itertools
import json
import ssl

import pytest

from r3srv import settings
from r3srv.cli import build_parser
from r3srv.data_parallel import replica_argv, supervisor_headers
from r3srv.errors import ConfigError
from r3srv.security import ServeSecurity
from r3srv.server.auth import ApiKeys, Authenticate, bearer_token
from r3srv.server.declare import Access, access_by_path
from r3srv.server.fanout import forwarded_headers
from r3srv.server.routes import ROUTE_HANDLERS

API, ADMIN = "api-key-Zq1", "admin-key-Xw9"
PRESENTED = {"none": None, "wrong": "Bearer not-a-key", "api": f"Bearer {API}", "admin": f"Bearer {ADMIN}",
             "basic": f"Basic {API}", "api, lowercase scheme": f"bearer {API}"}


def expected_status(has_api: bool, has_admin: bool, protect: bool, access: Access, presented: str) -> int | None:
    """The rules of docs/security.md, written as a table of which keys open a route (None: open)."""
    if access is Access.PROBE and not protect:
        return None
    if access is Access.ADMIN:
        opening = {"admin"} if has_admin else {"api", "api, lowercase scheme"} if has_api else None
    else:
        opening = ({"api", "api, lowercase scheme"} | ({"admin"} if has_admin else set())) if has_api else None
    if opening is None or presented in opening:
        return None
    api_key_on_admin_route = access is Access.ADMIN and has_admin and has_api and presented in ("api", "api, lowercase scheme")
    return 403 if api_key_on_admin_route else 401


CASES = list(itertools.product([False, True], [False, True], [False, True], list(Access), list(PRESENTED)))


@pytest.mark.parametrize("has_api,has_admin,protect,access,presented", CASES)
def test_refusal_follows_the_rules_for_every_configuration(has_api, has_admin, protect, access, presented):
    keys = ApiKeys.from_keys(["other-api-key", API] if has_api else [], [ADMIN] if has_admin else [],
                             protect_probes=protect)
    assert keys.refusal(access, PRESENTED[presented]) == expected_status(has_api, has_admin, protect, access, presented)


def test_bearer_token_is_read_as_vllm_reads_it():
    assert bearer_token("Bearer abc") == "abc"
    assert bearer_token("BEARER abc") == "abc"
    assert bearer_token("Bearer  abc") == " abc"  # the rest of the header is the token
    for header in (None, "", "Bearer", "Bearer ", "Basic abc", "abc"):
        assert bearer_token(header) is None


def test_the_fleet_credential_is_an_admin_key_else_an_api_key_and_no_repr_shows_a_key():
    assert ApiKeys.from_keys([API], [ADMIN]).fleet_credential == ADMIN
    assert ApiKeys.from_keys([API], []).fleet_credential == API
    assert ApiKeys.from_keys([], []).fleet_credential is None
    keys = ApiKeys.from_keys([API], [ADMIN])
    assert API not in repr(keys) and ADMIN not in repr(keys)
    guard = ServeSecurity(api_keys=(API,), admin_keys=(ADMIN,))
    assert API not in repr(guard) and ADMIN not in repr(guard)


def _call(app, path: str, headers: list[tuple[bytes, bytes]], method: str = "POST") -> tuple[int, dict, dict]:
    """One request through an ASGI app whose body must never be read; (status, headers, body)."""
    sent: list[dict] = []

    async def receive():
        raise AssertionError("the body was read")

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "headers": headers}
    asyncio.run(app(scope, receive, send))
    start, body = sent[0], b"".join(m.get("body", b"") for m in sent[1:])
    return start["status"], dict(start["headers"]), json.loads(body)


def test_the_layer_answers_openai_errors_before_the_body_and_names_no_key():
    reached = []

    async def app(scope, receive, send):
        reached.append(scope["path"])

    layer = Authenticate(app, ApiKeys.from_keys([API], [ADMIN]), access_by_path(ROUTE_HANDLERS))
    status, headers, body = _call(layer, "/v1/completions", [(b"authorization", b"Bearer wrong-key-123")])
    assert status == 401 and headers[b"www-authenticate"].startswith(b"Bearer")
    assert body["error"]["code"] == 401 and body["error"]["type"] == "AuthenticationError"
    assert "wrong-key-123" not in json.dumps(body) and API not in json.dumps(body)
    status, _, body = _call(layer, "/update_weights_from_disk", [(b"authorization", f"Bearer {API}".encode())])
    assert status == 403 and body["error"]["type"] == "PermissionDeniedError" and API not in json.dumps(body)
    for path in ("/schema/openapi.json", "/no/such/route"):  # undeclared paths need an inference key
        assert _call(layer, path, [], method="GET")[0] == 401
    assert reached == []
    asyncio.run(layer({"type": "http", "method": "GET", "path": "/health", "headers": []}, None, None))
    asyncio.run(layer({"type": "http", "method": "POST", "path": "/v1/completions",
                       "headers": [(b"authorization", f"Bearer {ADMIN}".encode())]}, None, None))
    assert reached == ["/health", "/v1/completions"]


def _security(*flags: str, environ: dict[str, str] | None = None) -> ServeSecurity:
    return ServeSecurity.from_args(build_parser().parse_args(["serve", *flags]), environ or {})


def test_keys_come_from_the_flags_else_the_environment():
    environ = {"R3SRV_API_KEY": "e1, e2", "R3SRV_ADMIN_API_KEY": "ea"}
    assert settings.secret_keys("api_key", environ) == ["e1", "e2"]
    from_env = _security(environ=environ)
    assert from_env.api_keys == ("e1", "e2") and from_env.admin_keys == ("ea",)
    given = _security("--api-key", "f1", "f2", environ=environ)
    assert given.api_keys == ("f1", "f2") and given.admin_keys == ("ea",)
    # what a fleet's replica is given: the same keys, through its environment
    assert settings.secret_keys("api_key", given.key_environ()) == ["f1", "f2"]
    assert settings.secret_keys("admin_api_key", given.key_environ()) == ["ea"]


def test_a_fleet_gives_its_replicas_keys_by_environment_and_calls_them_with_its_admin_key(tmp_path):
    cert = tmp_path / "cert.pem"
    cert.write_text("not read here")
    parser = build_parser()
    args = parser.parse_args(["serve", "m", "-dp", "2", "--api-key", API, "--admin-api-key", ADMIN, "--protect-probes",
                              "--ssl-certfile", str(cert), "--ssl-keyfile", str(cert), "--allowed-weight-paths",
                              str(tmp_path)])
    guard = ServeSecurity.from_args(args, {})
    argv = replica_argv(parser, args, model="m", port=9, device="cpu", weight_version="0")
    assert not [a for a in argv if API in a or ADMIN in a or a.startswith("--ssl")]  # keys by environment; TLS ends at the front
    child = parser.parse_args(argv[3:])
    assert child.protect_probes and child.allowed_weight_paths == [str(tmp_path)]  # the replica guards as the front
    assert ServeSecurity.from_args(child, guard.key_environ()).keys() == guard.keys()
    # the supervisor's own calls and every call the front makes carry the admin key, in place of the client's
    assert supervisor_headers(guard) == {"authorization": f"Bearer {ADMIN}"}
    assert supervisor_headers(_security("--api-key", API)) == {"authorization": f"Bearer {API}"}
    assert supervisor_headers(_security()) == {}
    client = [(b"host", b"fleet"), (b"authorization", f"Bearer {API}".encode()), (b"x-trace", b"1")]
    assert forwarded_headers(client, credential=ADMIN) == [(b"x-trace", b"1"), (b"authorization", f"Bearer {ADMIN}".encode())]
    assert forwarded_headers(client) == client[1:]


@pytest.mark.parametrize("flags,problem", [
    (("--api-key", "a,b"), "--api-key"),
    (("--admin-api-key", " padded"), "--admin-api-key"),
    (("--ssl-keyfile", "/etc/hostname"), "--ssl-certfile"),
    (("--ssl-certfile", "/etc/hostname", "--ssl-cert-reqs", "2"), "--ssl-ca-certs"),
    (("--ssl-certfile", "/nonexistent.pem"), "not a file"),
    (("--allowed-weight-paths", "/nonexistent-dir"), "not a directory"),
])
def test_combinations_that_cannot_work_are_config_errors(flags, problem):
    with pytest.raises(ConfigError, match=problem) as err:
        _security(*flags)
    assert "padded" not in str(err.value)  # a key is never echoed


def test_tls_flags_reach_uvicorn_as_vllms_do(tmp_path):
    cert = tmp_path / "cert.pem"
    cert.write_text("x")
    guard = _security("--ssl-certfile", str(cert), "--ssl-keyfile", str(cert), "--ssl-ca-certs", str(cert),
                      "--ssl-cert-reqs", "2")
    assert guard.uvicorn_ssl() == {"ssl_keyfile": str(cert), "ssl_certfile": str(cert), "ssl_ca_certs": str(cert),
                                   "ssl_cert_reqs": ssl.CERT_REQUIRED}
    assert _security().uvicorn_ssl() == {}


def test_exposure_warnings_beyond_loopback_only(tmp_path):
    open_server = _security()
    assert open_server.exposure_warnings("127.0.0.1", weight_updates=True) == []
    assert open_server.exposure_warnings("localhost", weight_updates=True) == []
    warned = " ".join(open_server.exposure_warnings("0.0.0.0", weight_updates=True))
    assert "--api-key" in warned and "--allowed-weight-paths" in warned
    hardened = _security("--api-key", "k", "--admin-api-key", "a", "--allowed-weight-paths", str(tmp_path))
    assert [w for w in hardened.exposure_warnings("10.0.0.1", weight_updates=True) if "clear text" not in w] == []
