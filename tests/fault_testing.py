"""Driving a real server with requests in flight while something fails (tests/test_faults.py,
tests/test_fleet_security.py): background calls, the server's metrics, and when a request is in."""

from __future__ import annotations

import base64
import io
import json
import socket
import threading
import time

import httpx
import numpy as np


def completion(url: str, prompt: list[int], max_tokens: int, **headers: str) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0,
            "return_token_ids": True, "return_routed_experts": True}
    return httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=300)


def tokens_and_rows(response: httpx.Response) -> tuple[list[int], np.ndarray | None, str]:
    """A finished choice's tokens, rows and finish reason; the rows checked against the tokens. An
    aborted choice has none (an abort frees its rows with its KV blocks, README)."""
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    if choice["finish_reason"] == "abort":
        assert choice["routed_experts"] is None
        return choice["token_ids"], None, "abort"
    rows = np.load(io.BytesIO(base64.b64decode(choice["routed_experts"])))
    assert rows.shape[0] == len(choice["prompt_token_ids"]) + len(choice["token_ids"]) - 1
    return choice["token_ids"], rows, choice["finish_reason"]


def metric(url: str, name: str, **headers: str) -> float:
    for line in httpx.get(url + "/metrics", headers=headers, timeout=30).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


def taken_in(port: int, client_port: int | None = None) -> int:
    """How many of the server's connections on `port` (from `client_port` only, if given) are open
    with nothing left unread (/proc/net/tcp: established, receive queue empty): requests it took in."""
    count = 0
    for line in open("/proc/net/tcp").read().splitlines()[1:]:
        fields = line.split()
        local, remote, state, queues = fields[1], fields[2], fields[3], fields[4]
        if (int(local.split(":")[1], 16) == port and state == "01" and int(queues.split(":")[1], 16) == 0
                and client_port in (None, int(remote.split(":")[1], 16))):
            count += 1
    return count


class RawPost(threading.Thread):
    """A JSON POST written on its own socket before the constructor returns, its answer read in
    the background: `taken_in()` says when the server has read it all."""

    def __init__(self, url: str, path: str, body: dict, headers: dict[str, str] | None = None) -> None:
        super().__init__(daemon=True)
        host, port = url.removeprefix("http://").split(":")
        self.port = int(port)
        self.sock = socket.create_connection((host, self.port))
        self.sock.settimeout(300)
        data = json.dumps(body).encode()
        head = [f"POST {path} HTTP/1.1", f"Host: {host}", "Content-Type: application/json", "Connection: close",
                f"Content-Length: {len(data)}", *(f"{k}: {v}" for k, v in (headers or {}).items())]
        self.sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + data)
        self.answer = b""
        self.start()

    def taken_in(self) -> bool:
        return taken_in(self.port, self.sock.getsockname()[1]) == 1

    def run(self) -> None:
        self.answer = b"".join(iter(lambda: self.sock.recv(65536), b""))
        self.sock.close()

    def result(self, timeout: float = 300.0) -> tuple[int, str]:
        """(status, body); (0, "") for a connection closed without an answer."""
        self.join(timeout)
        assert not self.is_alive(), "the request never ended"
        head, _, body = self.answer.partition(b"\r\n\r\n")
        return (int(head.split()[1]) if head else 0), body.decode(errors="replace")


def accepting(url: str) -> bool:
    try:
        httpx.get(url + "/health", timeout=5)
        return True
    except httpx.TransportError:
        return False


def wait_until(condition, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.05)


class InFlight(threading.Thread):
    """A call run in the background; `.response` once it ends."""

    def __init__(self, call, *args, **kwargs) -> None:
        super().__init__(daemon=True)
        self.call, self.args, self.kwargs = call, args, kwargs
        self.response: httpx.Response | None = None
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.response = self.call(*self.args, **self.kwargs)
        except BaseException as exc:  # a connection the server closed: the test says whether that is fine
            self.error = exc

    def result(self, timeout: float = 300.0) -> httpx.Response:
        self.join(timeout)
        assert not self.is_alive(), "the request never ended"
        if self.error is not None:
            raise self.error
        return self.response
