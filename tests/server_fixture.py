"""Run `r3srv serve` as a real subprocess on a free 127.0.0.1 port (vLLM's RemoteOpenAIServer pattern).

Used by the server tests and benchmarks: start it, poll /health, hand out the base
URL, and on exit stop it with SIGTERM and record its exit code (a clean stop is 0).
"""

from __future__ import annotations

import collections
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from r3srv.net import bound_socket

if TYPE_CHECKING:
    from step_gate import StepGate

# Small KV pool: fast to allocate, plenty for tests (256 blocks x 16 tokens).
# the CPU even on a GPU machine (serve's default is auto): the tests compare with CPU engines
TEST_SERVER_ARGS = ("--device", "cpu", "--num-kv-blocks", "256", "--max-num-seqs", "16", "--log-level", "warning")


# the ports free_port() handed out, still bound by this process (the latest _MAX_HELD of them)
_held: collections.deque[socket.socket] = collections.deque()
_MAX_HELD = 256


def free_port() -> int:
    """A free port that this process keeps bound (not listening) until many later ones were
    handed out: what a test starts on it binds it all the same (uvicorn, torch's TCPStore and the
    routers bind with SO_REUSEADDR, as `r3srv.net.bound_socket` does), while other processes'
    port-0 binds and outgoing connections cannot take it in between (a port released at once was
    taken so in a CI run, seconds before the process meant to listen on it bound it)."""
    sock = bound_socket("127.0.0.1", 0)
    _held.append(sock)
    if len(_held) > _MAX_HELD:
        _held.popleft().close()
    return sock.getsockname()[1]


def serve_command(*args: str, step_gate: Path | None = None) -> list[str]:
    """`r3srv serve ARGS`; with step_gate, its engine steps only as that gate file allows
    (tests/step_gate.py)."""
    if step_gate is not None:
        return [sys.executable, str(Path(__file__).with_name("gated_serve.py")), str(step_gate), "serve", *args]
    return [sys.executable, "-m", "r3srv.cli", "serve", *args]


class ServerExited(RuntimeError):
    """The server process ended before it answered /health."""

    def __init__(self, name: str, returncode: int, log: str) -> None:
        super().__init__(f"{name} exited with {returncode}:\n{log}")
        self.log = log


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float, name: str, log: Callable[[], str], *,
                 interval: float, **client: Any) -> None:
    """Poll `url`/health until it answers 200; ServerExited if `proc` ends first, TimeoutError
    (with the log) after `timeout` seconds. `client`: httpx's TLS arguments (verify, cert) and headers."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerExited(name, proc.returncode, log())
        try:
            if httpx.get(url + "/health", timeout=2.0, **client).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(interval)
    raise TimeoutError(f"{name} did not become healthy in {timeout}s:\n{log()}")


class _PortTaken(RuntimeError):
    """Another process bound the port between `free_port()` and the server's own bind."""


class RemoteServer:
    """step_gate: a StepGate (tests/step_gate.py) that holds this server's engine steps. `env`:
    variables added to the server's environment (keys: R3SRV_API_KEY); `scheme` "https" and
    `client` (httpx's verify, cert, headers) for a server that serves TLS or keys its probes.
    `own_session`: the server leads a session of its own (setsid), as a server started from a
    login shell does; where the kernel groups processes by session for scheduling (autogroup),
    it then gets its own share of a loaded machine instead of splitting the caller's."""

    def __init__(self, *args: str, startup_timeout: float = 180.0, bind_attempts: int = 3,
                 step_gate: StepGate | None = None, env: dict[str, str] | None = None, scheme: str = "http",
                 own_session: bool = False, **client: Any) -> None:
        self._gate_path = None if step_gate is None else step_gate.path
        self._env, self._scheme, self._client = env or {}, scheme, client
        self._own_session = own_session
        # free_port() only finds a port that is free now; on a busy CI machine another
        # process can take it before the server binds, so a lost race is retried on a new one.
        for attempt in range(bind_attempts):
            self._start(args)
            try:
                self._wait_healthy(startup_timeout)
                return
            except _PortTaken:
                self.stop()
                os.unlink(self._log.name)
                if attempt + 1 == bind_attempts:
                    raise
            except BaseException:
                self.stop()
                raise

    def _start(self, args: tuple[str, ...]) -> None:
        self.port = free_port()
        self.url = f"{self._scheme}://127.0.0.1:{self.port}"
        self._log = tempfile.NamedTemporaryFile(prefix="r3srv-serve-", suffix=".log", delete=False)
        env = dict(os.environ, PYTHONUNBUFFERED="1", **self._env)
        self.proc = subprocess.Popen(
            serve_command("--host", "127.0.0.1", "--port", str(self.port), *args, step_gate=self._gate_path),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=self._own_session,
        )
        self.returncode: int | None = None

    @property
    def log(self) -> str:
        path = Path(self._log.name)
        return path.read_text(errors="replace") if path.exists() else getattr(self, "final_log", "")

    def _wait_healthy(self, timeout: float) -> None:
        try:
            wait_healthy(self.url, self.proc, timeout, "r3srv serve", lambda: self.log, interval=0.2, **self._client)
        except ServerExited as exited:
            if "address already in use" in exited.log.lower():
                raise _PortTaken(f"port {self.port} was taken before r3srv serve could bind it:\n{exited.log}") from None
            raise

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.returncode = self.proc.returncode
        self._log.close()
        self.final_log = self.log
        return self.returncode

    def __enter__(self) -> "RemoteServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        os.unlink(self._log.name)
