"""`r3srv serve --tensor-parallel-size 2 --device cpu`: the same routed experts, sampling masks
and (within the all-reduce's rounding) router weights as the single-device server; a worker that dies makes /health 503 and the server exit non-zero
with the worker's fate in its log; a SIGKILLed server leaves no worker behind."""

import base64
import io
import os
import signal
import time

import httpx
import numpy as np
import pytest
from server_fixture import TEST_SERVER_ARGS, RemoteServer

from r3srv import serial

pytestmark = pytest.mark.slow  # real servers

ONE = (*TEST_SERVER_ARGS, "--enable-return-routed-experts", "--enable-return-routed-expert-weights", "--dtype", "float32")
TP2 = (*ONE, "--tensor-parallel-size", "2")
# seeded sampling wide enough for masks of many ids (the built-in model's random weights are peaked)
SAMPLED = {"max_new_tokens": 8, "temperature": 2.0, "top_k": 30, "top_p": 0.95, "ignore_eos": True,
           "sampling_seed": 5}
WEIGHT_RTOL, WEIGHT_ATOL = 1e-5, 1e-6  # tests/test_parallel_signals.py's (the all-reduce sums in another order)


def children(pid: int) -> list[int]:
    """Live child processes of `pid` (from /proc: no psutil here)."""
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                kids.append(int(entry))
    return kids


def workers_of(server: RemoteServer) -> list[int]:
    """The server's tensor-parallel worker (multiprocessing's spawn also starts a resource tracker)."""
    found = []
    for pid in children(server.proc.pid):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"spawn_main" in f.read():
                found.append(pid)
    return found


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def wait_for(condition, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return False


def rows(server: RemoteServer, prompt: str) -> tuple[list[int], np.ndarray]:
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    choice = httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()["choices"][0]
    return choice["token_ids"], np.load(io.BytesIO(base64.b64decode(choice["routed_experts"])))


def signals(server: RemoteServer, prompt: str) -> dict:
    """SGLang's /generate with sampling masks and router weights, decoded as a client does."""
    ids = list(prompt.encode())
    body = {"input_ids": ids, "sampling_params": SAMPLED, "return_sampling_mask": True,
            "return_routed_expert_weights": True}
    r = httpx.post(server.url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    meta = out["meta_info"]
    weights = serial.decode_expert_weights(meta["routed_expert_weights"])
    # SGLang's rows: base64 of int32, in the weights' shape
    experts = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=np.int32).reshape(weights.shape)
    return {"tokens": out["output_ids"], "masks": meta["output_token_sampling_mask"], "rows": experts,
            "weights": weights}


def test_tp2_server_serves_single_device_rows_and_fails_fast_when_a_worker_dies():
    """One TP=2 server: its rows, masks and router weights equal the single-device server's; then
    its worker is killed."""
    prompts = ["The quick brown fox", "r3srv splits heads, experts and the vocabulary over ranks"]
    with RemoteServer(*ONE) as one:
        expected = [rows(one, p) for p in prompts]
        sampled = [signals(one, p) for p in prompts]
    server = RemoteServer(*TP2)
    try:
        for (tokens, experts), prompt in zip(expected, prompts):
            got_tokens, got_experts = rows(server, prompt)
            assert got_tokens == tokens
            np.testing.assert_array_equal(got_experts, experts)
        for want, prompt in zip(sampled, prompts):
            got = signals(server, prompt)
            assert got["tokens"] == want["tokens"] and got["masks"] == want["masks"]
            assert min(len(m) for m in got["masks"]) > 1  # supports wide enough to matter
            np.testing.assert_array_equal(got["rows"], want["rows"])
            assert np.count_nonzero(got["weights"]) > 0
            np.testing.assert_allclose(got["weights"], want["weights"], rtol=WEIGHT_RTOL, atol=WEIGHT_ATOL)
        (worker,) = workers_of(server)
        os.kill(worker, signal.SIGKILL)
        assert wait_for(lambda: server.proc.poll() is not None or _health(server) == 503)
        assert server.proc.wait(timeout=30) == 3  # EXIT_ENGINE_FAILED
        assert "r3srv-tp-rank1" in server.log and "exited with code -9" in server.log
    finally:
        server.stop()
        os.unlink(server._log.name)


def test_a_sigkilled_server_leaves_no_worker():
    server = RemoteServer(*TP2)
    try:
        (worker,) = workers_of(server)
        server.proc.kill()
        server.proc.wait(timeout=30)
        assert wait_for(lambda: gone(worker), timeout=15), f"worker {worker} outlived its server"
    finally:
        server.stop()
        os.unlink(server._log.name)


def _health(server: RemoteServer) -> int | None:
    try:
        return httpx.get(server.url + "/health", timeout=2).status_code
    except httpx.HTTPError:
        return None

