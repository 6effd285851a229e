"""`r3srv serve`: flags, configuration errors before binding, clean stop on SIGINT."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from server_fixture import TEST_SERVER_ARGS, RemoteServer, free_port, serve_command, wait_healthy

from r3srv import engine_options
from r3srv.cli import build_parser, main

pytestmark = pytest.mark.slow  # real servers


def test_console_script_is_installed():
    script = shutil.which("r3srv", path=str(Path(sys.executable).parent))
    assert script is not None, "pyproject's [project.scripts] r3srv entry is not installed"
    out = subprocess.run([script, "serve", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    for flag in (
        "--host",
        "--port",
        "--enable-return-routed-experts",
        "--served-model-name",
        "--max-model-len",
        "--max-num-seqs",
        "--dtype",
        "--device",
        "--enable-prefix-caching",
        "--no-enable-prefix-caching",
        "--pipeline-parallel-size",
        "--decode-context-parallel-size",
        "--prefill-context-parallel-size",
        "--seed",
        "--tensor-parallel-size",
        "--data-parallel-size",
    ):
        assert flag in out.stdout


def test_flags_map_onto_engine_arguments():
    args = build_parser().parse_args(
        ["serve", "/ckpt", "--enable-return-routed-experts", "--no-enable-prefix-caching", "--max-model-len", "2112",
         "--max-num-seqs", "4", "--dtype", "float32", "--seed", "9", "-pp", "1"]
    )
    assert args.model == "/ckpt" and args.host == "127.0.0.1" and args.port == 8000
    kw = engine_options.from_args(args)
    assert kw["enable_return_routed_experts"] is True and kw["enable_prefix_caching"] is False
    assert (kw["max_model_len"], kw["max_num_seqs"], kw["dtype"], kw["seed"]) == (2112, 4, "float32", 9)
    default = engine_options.from_args(build_parser().parse_args(["serve"]))
    assert default["enable_return_routed_experts"] is False and default["enable_prefix_caching"] is True
    assert default["device"] == "auto" and default["tensor_parallel_size"] == default["data_parallel_size"] == 1
    assert engine_options.from_args(build_parser().parse_args(["serve", "-tp", "1", "-dp", "1"]))["tensor_parallel_size"] == 1


def test_device_auto_takes_the_gpu_when_there_is_one():
    import torch

    from r3srv.config import EngineConfig

    assert EngineConfig(device="auto").device == ("cuda" if torch.cuda.is_available() else "cpu")


def test_bad_config_exits_before_binding():
    port = free_port()
    out = subprocess.run(
        serve_command("--port", str(port), "--pipeline-parallel-size", "2"), capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2, out.stderr
    assert "configuration error" in out.stderr and "pipeline_parallel_size=2" in out.stderr
    assert "Uvicorn running" not in out.stderr + out.stdout


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--decode-context-parallel-size", "2"], ["decode_context_parallel_size=2"]),
        (["--prefill-context-parallel-size", "4"], ["prefill_context_parallel_size=4"]),
        (["--dtype", "float8"], ["dtype"]),
        (["--device", "tpu"], ["device"]),
        (["--tensor-parallel-size", "3"], ["cannot be split", "over 3 ranks"]),
        (["-tp", "2", "--nnodes", "2"], ["master_port is required"]),
        (["--node-rank", "1"], ["node_rank=1"]),
        (["-tp", "2", "-dp", "2", "--master-port", "29555"], ["--master-port"]),  # each replica's ranks: a free port
        (["-dp", "2", "--device", "cuda:1"], ["cuda:1", "--data-parallel-size 2"]),  # a fleet needs a device each
        (["/no/such/checkpoint"], ["/no/such/checkpoint"]),
    ],
)
def test_bad_configs_are_reported(flags, words, capsys):
    """In-process (no torch start-up per case): main() returns 2 with the engine's message, never serving."""
    rc = main(["serve", "--port", str(free_port()), "--log-level", "error", *flags])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "configuration error" in err or "cannot load" in err
    assert all(w in err for w in words), err


def test_sigint_stops_cleanly_and_ends_open_streams(gate):
    """Ctrl-C with a stream open: the stream ends with finish_reason "abort" and [DONE] (not cut by
    uvicorn's graceful-shutdown timeout, which would end it without either), exit 0.
    (SIGTERM: every server fixture's teardown asserts exit status 0.)"""
    gate.allow(2)  # the stream is in flight, short of its 3000 tokens, when Ctrl-C comes
    srv = RemoteServer(*TEST_SERVER_ARGS, step_gate=gate)
    result: dict = {}

    def stream() -> None:
        body = {"prompt": "x", "max_tokens": 3000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        result["done"] = lines[-1] == "data: [DONE]"
        result["finish"] = json.loads(lines[-2][6:])["choices"][0]["finish_reason"]

    try:
        thread = threading.Thread(target=stream)
        thread.start()
        deadline = time.monotonic() + 30
        while "r3srv_num_requests_running 1.0" not in httpx.get(srv.url + "/metrics").text:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        rc = srv.stop(signal.SIGINT, timeout=30)
        thread.join(timeout=30)
        assert rc == 0, srv.log
        assert result == {"done": True, "finish": "abort"}
        assert "Traceback" not in srv.log, srv.log
        with pytest.raises(httpx.ConnectError):
            httpx.get(srv.url + "/health", timeout=2)
    finally:
        srv.stop()
        gate.open()


def test_server_fixture_retries_when_its_port_is_taken(monkeypatch):
    """free_port() can race with another process on a busy machine: the fixture must retry, not fail."""
    import server_fixture

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        taken_port = taken.getsockname()[1]
        ports = iter([taken_port])
        real_free_port = server_fixture.free_port
        monkeypatch.setattr(server_fixture, "free_port", lambda: next(ports, None) or real_free_port())
        with RemoteServer(*TEST_SERVER_ARGS, startup_timeout=120) as srv:
            assert srv.port != taken_port
            assert httpx.get(srv.url + "/health", timeout=10).status_code == 200


def test_serve_answers_on_an_inherited_bound_socket():
    """--listen-fd: the server takes a socket its parent bound (a fleet's replicas start so: the
    port is never free between its choice and the server's bind), refusing connections until it
    serves, then answers on it; the fleet's own --listen-fd is not handed to its replicas (each
    gets the socket bound for it)."""
    from r3srv.data_parallel import replica_argv
    from r3srv.front.replicas import spawn
    from r3srv.net import bound_socket

    parser = build_parser()
    fleet_args = parser.parse_args(["serve", "m", "-dp", "2", "--listen-fd", "5"])
    assert fleet_args.listen_fd == 5
    assert "--listen-fd" not in replica_argv(parser, fleet_args, model="m", port=1, device="cpu", weight_version="v")
    with bound_socket("127.0.0.1", 0) as sock:
        port = sock.getsockname()[1]
        with pytest.raises(ConnectionRefusedError):  # bound, not listening: nothing answers yet
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        proc = spawn(serve_command("--listen-fd", str(sock.fileno()), "--port", str(port), *TEST_SERVER_ARGS),
                     pass_fds=(sock.fileno(),))
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc, 180, "r3srv serve", lambda: "", interval=0.2)
        body = {"prompt": [1, 2, 3], "max_tokens": 2, "return_token_ids": True}
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60)
        assert answer.status_code == 200 and len(answer.json()["choices"][0]["token_ids"]) == 2, answer.text
    finally:
        proc.terminate()
        assert proc.wait(timeout=60) == 0
