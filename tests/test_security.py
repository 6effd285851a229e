"""A server exposed on a network, against real `r3srv serve` processes (docs/security.md): every
route probed without a key, with a wrong key and with the API key on an admin route (nothing
changes); the keys that do open each kind of route, through the openai SDK too; the schema saying
so; every path field of a request confined to --allowed-weight-paths (traversal, symlinked
directories and shards, an index naming files outside); trainer hosts confined; a body trickled
in byte by byte cut while a slow real upload gets through; TLS with and without a client
certificate."""

from __future__ import annotations

import importlib
import json
import pkgutil
import re
import socket
import ssl
import time

import httpx
import msgspec
import openai
import pytest
from server_fixture import TEST_SERVER_ARGS, RemoteServer
from tiny_checkpoints import write_tiny_checkpoint

import r3srv.server.protocol as protocol
from r3srv.server.declare import Access
from r3srv.server.routes import ROUTE_HANDLERS

pytestmark = pytest.mark.slow

API_KEYS = ("inference-key-one", "inference-key-two")
ADMIN_KEY = "admin-key-three"
BAD_KEY = "not-a-key-of-this-server"
BODY_TIMEOUT_S, MIN_BODY_RATE = 3.0, 50.0


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    root = tmp_path_factory.mktemp("weights")
    served = write_tiny_checkpoint(root / "served", "qwen3_moe", seed=0)
    allowed = root / "allowed"
    write_tiny_checkpoint(allowed / "v1", "qwen3_moe", seed=1)
    outside = write_tiny_checkpoint(root / "outside" / "v2", "qwen3_moe", seed=2)
    return root, served, allowed, outside


@pytest.fixture(scope="module")
def server(weights):
    root, served, allowed, _ = weights
    # every optional route group on, so that each route is refused live (vLLM's dev-mode routes too)
    with RemoteServer(str(served), "--enable-weight-updates", "--enable-return-routed-experts", "--enable-lora",
                      "--enable-sleep-mode", "--enable-collective-rpc", "--admin-api-key", ADMIN_KEY, "--allowed-weight-paths", str(allowed),
                      "--allowed-trainer-hosts", "127.0.0.1", "localhost",
                      "--timeout-body", str(BODY_TIMEOUT_S), "--min-body-rate", str(MIN_BODY_RATE),
                      *TEST_SERVER_ARGS, env={"R3SRV_API_KEY": ",".join(API_KEYS)}) as srv:
        yield srv
    assert srv.returncode == 0, srv.log
    assert not [k for k in (*API_KEYS, ADMIN_KEY, BAD_KEY) if k in srv.final_log], "a key reached the log"


def admin(server) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers=bearer(ADMIN_KEY), timeout=120)


def fingerprint(server) -> dict:
    """What a control, weight or memory call would change."""
    with admin(server) as http:
        info = http.get("/server_info").json()
        return {"paused": http.get("/is_paused").json(), "state": info["internal_states"],
                "weights": (info["weight_version"], info["model_path"]),
                "gauges": _metric(http, "r3srv_memory_released") + _metric(http, "r3srv_generation_paused"),
                "updates": _metric(http, "r3srv_weight_updates_total")}


def _metric(http: httpx.Client, name: str) -> list[str]:
    return sorted(line for line in http.get("/metrics").text.splitlines() if line.startswith(name))


def every_route() -> list[tuple[str, str, Access]]:
    return sorted({(method, path, h.opt["access"]) for h in ROUTE_HANDLERS for path in h.paths
                   for method in h.http_methods if method not in ("HEAD", "OPTIONS")}, key=str)


def test_every_route_refuses_missing_wrong_and_insufficient_keys_and_nothing_changes(server):
    before = fingerprint(server)
    refused = {}
    with httpx.Client(base_url=server.url, timeout=120) as http:
        for method, path, access in every_route():
            if access is Access.PROBE:  # open, for routers and Prometheus
                assert http.request(method, path).status_code not in (401, 403), path
                continue
            body = b'{"mode": "abort", "model_path": "/", "tags": null}' if method == "POST" else None
            attempts = {"no key": {}, "wrong key": bearer(BAD_KEY), "not bearer": {"authorization": ADMIN_KEY}}
            if access is Access.ADMIN:
                attempts["API key"] = bearer(API_KEYS[1])
            for label, headers in attempts.items():
                r = http.request(method, path, content=body, headers=headers)
                refused[(path, label)] = r.status_code
                error = r.json()["error"]
                assert error["code"] == r.status_code
                assert not [k for k in (*API_KEYS, ADMIN_KEY, BAD_KEY) if k in r.text], "an answer names a key"
                if r.status_code == 401:
                    assert r.headers["www-authenticate"].startswith("Bearer")
    expected = {(p, label): 403 if label == "API key" else 401 for (p, label) in refused}
    assert refused == expected
    assert {path for path, _ in refused} >= {"/update_weights_from_disk", "/pause_generation", "/v1/completions",
                                              "/init_weights_update_group", "/release_memory_occupation",
                                              "/sleep", "/wake_up", "/collective_rpc"}
    assert fingerprint(server) == before


def test_the_keys_open_their_routes_and_sdks_see_openais_errors(server):
    ok = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEYS[1], max_retries=0)
    model = ok.models.list().data[0].id
    assert ok.completions.create(model=model, prompt=[1, 2, 3], max_tokens=2).choices[0].finish_reason
    as_admin = openai.OpenAI(base_url=server.url + "/v1", api_key=ADMIN_KEY, max_retries=0)
    assert as_admin.models.list().data[0].id == model  # the admin key also opens inference routes
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key=BAD_KEY, max_retries=0).models.list()
    with httpx.Client(base_url=server.url, timeout=120) as http:
        assert http.post("/pause_generation", json={"mode": "abort"}, headers=bearer(API_KEYS[0])).status_code == 403
        assert http.post("/pause_generation", json={"mode": "abort"}, headers=bearer(ADMIN_KEY)).status_code == 200
        assert http.get("/is_paused", headers=bearer(ADMIN_KEY)).json()["is_paused"]
        assert http.post("/continue_generation", headers=bearer(ADMIN_KEY)).status_code == 200
        # vLLM's dev-mode routes: the API key is refused, the admin key opens them
        assert http.post("/sleep", params={"level": "0"}, headers=bearer(API_KEYS[0])).status_code == 403
        assert http.post("/sleep", params={"level": "0"}, headers=bearer(ADMIN_KEY)).json()["status"] == "sleeping"
        assert http.get("/is_sleeping", headers=bearer(ADMIN_KEY)).json() == {"is_sleeping": True}
        assert http.post("/wake_up", headers=bearer(ADMIN_KEY)).json()["status"] == "awake"
        assert http.get("/is_sleeping", headers=bearer(ADMIN_KEY)).json() == {"is_sleeping": False}


def test_the_schema_documents_the_bearer_scheme_and_the_refusals(server):
    schema = httpx.get(server.url + "/schema/openapi.json", headers=bearer(API_KEYS[0])).json()
    assert schema["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    access = {path: h.opt["access"] for h in ROUTE_HANDLERS for path in h.paths}
    for path, item in schema["paths"].items():
        for operation in item.values():
            if access[path] is Access.PROBE:
                assert "security" not in operation and "401" not in operation["responses"], path
            else:
                assert operation["security"] == [{"bearer": []}] and "401" in operation["responses"], path
            assert ("403" in operation["responses"]) == (access[path] is Access.ADMIN), path


# ---------------------------------------------------------------- weight sources


def request_path_fields() -> set[str]:
    """Every field of a request body that names a file or directory on the server."""
    found = set()
    for module in pkgutil.iter_modules(protocol.__path__):
        for name, obj in vars(importlib.import_module(f"{protocol.__name__}.{module.name}")).items():
            if isinstance(obj, type) and issubclass(obj, msgspec.Struct) and name.endswith("Request"):
                found |= {f.name for f in msgspec.structs.fields(obj) if re.search(r"(path|dir|file)s?$", f.name)}
    return found


# field -> (route, the body naming a directory)
PATH_FIELDS = {
    "model_path": ("/update_weights_from_disk", lambda d: {"model_path": d}),
    "weight_dir": ("/update_weights", lambda d: {"weight_dir": d}),
}


# the adapter loads' lora_path (on SGLang's /generate the same name selects a loaded adapter by name)
LORA_LOADS = {
    "/v1/load_lora_adapter": lambda d: {"lora_name": "outside", "lora_path": d},
    "/load_lora_adapter": lambda d: {"lora_name": "outside", "lora_path": d},
}


def test_every_path_field_of_a_request_is_confined():
    assert request_path_fields() == set(PATH_FIELDS) | {"lora_path"}, "a new path field: confine it and add it here"


def test_adapter_paths_outside_the_allowed_directories_are_403s(server, weights):
    root, _, allowed, outside = weights
    with admin(server) as http:
        for how, directory in escapes(root, allowed, outside).items():
            for route, body in LORA_LOADS.items():
                r = http.post(route, json=body(directory))
                assert r.status_code == 403, (how, route, r.text)
                assert r.json()["error"]["param"] == "lora_path" and "--allowed-weight-paths" in r.text, (how, r.text)
        # inside, the confinement lets it through: a checkpoint that is no adapter is the loader's 400
        for route, body in LORA_LOADS.items():
            r = http.post(route, json=body(str(allowed / "v1")))
            assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path", (route, r.text)
        assert http.get("/v1/models").json()["data"][1:] == []  # no adapter was loaded


def escapes(root, allowed, outside) -> dict[str, str]:
    """Directories that lead outside the allowed one, each a different way (made once per module)."""
    shard_out, indexed = allowed / "shard_out", allowed / "index_out"
    if not shard_out.exists():
        _make_escapes(allowed, outside, shard_out, indexed)
    return {
        "absolute": str(outside),
        "dot-dot": f"{allowed}/../outside/v2",
        "symlinked directory": str(allowed / "link_out"),
        "symlinked shard": str(shard_out),
        "index naming files outside": str(indexed),
        "nonexistent outside": str(root / "no-such-dir"),
        "nul byte": f"{allowed}/v1\u0000",
        "root": "/",
    }


def _make_escapes(allowed, outside, shard_out, indexed) -> None:
    (allowed / "link_out").symlink_to(outside, target_is_directory=True)
    shard_out.mkdir()
    for entry in outside.iterdir():  # everything real but the weights, which point outside
        target = shard_out / entry.name
        target.symlink_to(entry) if entry.suffix == ".safetensors" else target.write_bytes(entry.read_bytes())
    indexed.mkdir()
    (indexed / "config.json").write_bytes((outside / "config.json").read_bytes())
    shards = [p.name for p in outside.glob("*.safetensors")]
    weight_map = {f"tensor-{i}": f"../../outside/v2/{name}" for i, name in enumerate(shards)}
    (indexed / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_paths_outside_the_allowed_directories_are_403s_naming_the_field(server, weights):
    root, _, allowed, outside = weights
    before = fingerprint(server)
    with admin(server) as http:
        for how, directory in escapes(root, allowed, outside).items():
            for field, (route, body) in PATH_FIELDS.items():
                r = http.post(route, json=body(directory))
                assert r.status_code == 403, (how, field, r.text)
                error = r.json()["error"]
                assert error["param"] == field and error["type"] == "PermissionDeniedError", (how, error)
                assert "--allowed-weight-paths" in error["message"]
    after = fingerprint(server)
    assert after["weights"] == before["weights"] and after["paused"] == before["paused"]
    assert after["updates"] != before["updates"]  # counted as rejected updates


def test_paths_inside_load_through_their_symlinks_resolved(server, weights):
    _, _, allowed, _ = weights
    link = allowed / "link_in"
    link.symlink_to(allowed / "v1", target_is_directory=True)
    with admin(server) as http:
        for field, (route, body) in PATH_FIELDS.items():
            r = http.post(route, json=body(str(link)))
            assert r.status_code == 200, (field, r.text)
            assert http.get("/model_info").json()["model_path"] == str((allowed / "v1").resolve())


def test_trainer_hosts_outside_the_allowed_ones_are_403s(server):
    group = {"master_address": "192.0.2.7", "master_port": 29500, "rank_offset": 1, "world_size": 2,
             "group_name": "g", "backend": "gloo"}
    with admin(server) as http:
        r = http.post("/init_weights_update_group", json=group)
        assert r.status_code == 403 and r.json()["error"]["param"] == "master_address", r.text
        vllm = {"init_info": {k: group[k] for k in ("master_address", "master_port", "rank_offset", "world_size")}}
        r = http.post("/init_weight_transfer_engine", json=vllm)
        assert r.status_code == 403 and r.json()["error"]["param"] == "init_info.master_address", r.text


# ---------------------------------------------------------------- slow bodies


def _upload(server, body: bytes, chunk: int, pause: float) -> tuple[bytes, int]:
    """Send a completion request whose body arrives `chunk` bytes every `pause` seconds; the answer
    (b"" if the server closed the connection) and how many body bytes went out before it did."""
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.settimeout(120)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nConnection: close\r\n"
                 b"Authorization: Bearer %s\r\nContent-Length: %d\r\n\r\n" % (API_KEYS[0].encode(), len(body)))
    sent = 0
    try:
        while sent < len(body):
            sock.sendall(body[sent:sent + chunk])
            sent += len(body[sent:sent + chunk])
            time.sleep(pause)
        answer = b"".join(iter(lambda: sock.recv(65536), b""))
    except (BrokenPipeError, ConnectionResetError):
        answer = b""
    finally:
        sock.close()
    return answer, sent


def test_a_trickled_body_is_cut_and_a_slow_real_upload_gets_through(server):
    prompt = json.dumps({"prompt": [1] * 300, "max_tokens": 1}).encode()
    # 4 bytes a second: under any idle timeout, far under the rate; the whole body would take minutes
    answer, sent = _upload(server, prompt, chunk=1, pause=0.25)
    assert answer == b"" and sent < len(prompt) // 2, (answer[:200], sent)
    # ~20 times the rate, for longer than --timeout-body: read to its end
    answer, sent = _upload(server, prompt, chunk=100, pause=0.1 * BODY_TIMEOUT_S * MIN_BODY_RATE / 100)
    assert sent == len(prompt) and answer.startswith(b"HTTP/1.1 200"), answer[:300]


# ---------------------------------------------------------------- TLS


@pytest.fixture(scope="module")
def certificates(tmp_path_factory):
    trustme = pytest.importorskip("trustme")
    root = tmp_path_factory.mktemp("tls")
    ca, stranger = trustme.CA(), trustme.CA()
    files = {"ca": root / "ca.pem", "server": root / "server.pem", "client": root / "client.pem",
             "stranger": root / "stranger.pem"}
    ca.cert_pem.write_to_path(str(files["ca"]))
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(str(files["server"]))
    ca.issue_cert("trainer@example.org").private_key_and_cert_chain_pem.write_to_path(str(files["client"]))
    stranger.issue_cert("mallory@example.org").private_key_and_cert_chain_pem.write_to_path(str(files["stranger"]))
    return {k: str(v) for k, v in files.items()}


@pytest.fixture(scope="module", params=[(), ("--data-parallel-size", "2")], ids=["one server", "a fleet's front"])
def tls_server(certificates, request):
    c = certificates
    client = dict(verify=ssl.create_default_context(cafile=c["ca"]), headers=bearer(API_KEYS[0]))
    client["verify"].load_cert_chain(c["client"])
    with RemoteServer("--ssl-certfile", c["server"], "--ssl-keyfile", c["server"], "--ssl-ca-certs", c["ca"],
                      "--ssl-cert-reqs", str(int(ssl.CERT_REQUIRED)), "--protect-probes", *TEST_SERVER_ARGS,
                      *request.param, env={"R3SRV_API_KEY": API_KEYS[0]}, scheme="https", startup_timeout=300,
                      **client) as srv:
        yield srv, client
    assert srv.returncode == 0, srv.log


def test_tls_needs_a_client_certificate_of_the_servers_ca(tls_server, certificates):
    srv, client = tls_server
    with httpx.Client(base_url=srv.url, timeout=60, **client) as http:
        assert http.get("/health").status_code == 200
        assert http.get("/health", headers={"authorization": ""}).status_code == 401  # --protect-probes
        sdk = openai.OpenAI(base_url=srv.url + "/v1", api_key=API_KEYS[0], max_retries=0, http_client=http)
        assert sdk.completions.create(model=sdk.models.list().data[0].id, prompt=[1, 2], max_tokens=1).choices
        if http.get("/server_info").json().get("dp_size", 1) > 1:  # a fleet lists itself by the URL it is called at
            assert http.get("/list_workers").json() == {"urls": [srv.url]}
    without = ssl.create_default_context(cafile=certificates["ca"])
    stranger = ssl.create_default_context(cafile=certificates["ca"])
    stranger.load_cert_chain(certificates["stranger"])
    for context in (without, stranger):
        with pytest.raises(httpx.TransportError):
            httpx.get(srv.url + "/health", verify=context, headers=client["headers"], timeout=30)
    with pytest.raises(httpx.TransportError):  # plain HTTP on the TLS port
        httpx.get(srv.url.replace("https", "http") + "/health", timeout=30).raise_for_status()
