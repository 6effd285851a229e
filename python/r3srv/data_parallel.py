"""`r3srv serve --data-parallel-size N`: N replicas behind the SGLang router, supervised by this process.

Each replica is a child `r3srv serve` on a free 127.0.0.1 port (device cuda:i when there are N
CUDA devices, else the CPU; with --tensor-parallel-size M, cuda:i*M and the M-1 devices after
it, its ranks meeting on a free port of their own), started with `--fleet-peer-urls` naming its siblings so that a
control call made to any of them reaches all (server/fanout.py). sglang-router 0.3.2 listens on
the public --host/--port with cache-aware routing, so a conversation's next turn goes to the
replica that caches its prefix.

Keys and TLS (docs/security.md): the replicas get the fleet's keys through $R3SRV_API_KEY and
$R3SRV_ADMIN_API_KEY (never on their command lines), listen on 127.0.0.1 in plain HTTP, and
forward control calls to each other with the admin key (server/fanout.py); the router gets the
first API key (`--api-key`: sglang-router 0.3.2 requires it of its clients and sends it to the
workers) and the fleet's certificate (`--tls-cert-path`, `--tls-key-path`); the supervisor's own
polls carry the admin key.

The supervisor stays in the foreground: SIGTERM or SIGINT stops the router and every replica
(children also get SIGTERM from the kernel if the supervisor itself dies: no orphans). A replica
that exits is logged with its exit code and restarted on the same port, on the weights its
siblings serve now (their /model_info), while the router's health checks keep requests off it.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from r3srv import settings
from r3srv.errors import ConfigError
from r3srv.security import ServeSecurity

logger = logging.getLogger("r3srv.fleet")

ROUTER_MODULE = "sglang_router.launch_router"
EXIT_CONFIG_ERROR = 2
# Flags the supervisor sets itself on each replica; every other serve flag is passed on unchanged.
_REPLICA_FLAGS = {"model", "host", "port", "data_parallel_size", "device", "fleet_peer_urls", "weight_version",
                  "served_model_name", "help",
                  # keys reach a replica through its environment; TLS ends at the router
                  "api_key", "admin_api_key", "ssl_keyfile", "ssl_certfile", "ssl_ca_certs", "ssl_cert_reqs"}
MAX_RESTARTS = 5
# The router probes /health this often and takes a replica out after this many failures.
ROUTER_HEALTH_INTERVAL_S = 5
ROUTER_HEALTH_FAILURES = 2
# The router's info level narrates every registration step: r3srv's info shows its warnings.
_ROUTER_LOG_LEVELS = {"critical": "error", "error": "error", "warning": "warn", "info": "warn", "debug": "debug"}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def replica_devices(device: str, n: int, tp: int = 1) -> list[str]:
    """Each replica's --device: cuda:0, cuda:tp, cuda:2tp, ... (a replica's tp ranks take the
    devices from there on), or the CPU for all of them."""
    if device == "cpu":
        return ["cpu"] * n
    if device not in ("auto", "cuda"):
        raise ConfigError(f"--device {device} names one device; with --data-parallel-size {n} use auto, cuda or cpu")
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "auto" and count == 0:
        return ["cpu"] * n
    if count < n * tp:
        raise ConfigError(f"--data-parallel-size {n} x --tensor-parallel-size {tp} needs {n * tp} CUDA devices, "
                          f"{count} found")
    return [f"cuda:{i * tp}" for i in range(n)]


def replica_argv(parser: argparse.ArgumentParser, args: argparse.Namespace, *, model: str | None, port: int,
                 device: str, peers: list[str], weight_version: str, served_model_name: str | None = None) -> list[str]:
    """The `r3srv serve` command of one replica: the fleet's flags as given, plus its own place.

    A replica restarted on updated weights keeps the fleet's model name (served_model_name): by
    default the name comes from the checkpoint directory, and the router knows the fleet by it.
    """
    serve = _serve_parser(parser)
    argv = [sys.executable, "-m", "r3srv.cli", "serve"] + ([model] if model else [])
    for action in serve._actions:
        value = getattr(args, action.dest, None)
        if not action.option_strings or action.dest in _REPLICA_FLAGS or value == action.default:
            continue
        flag = action.option_strings[0]
        if isinstance(action, argparse.BooleanOptionalAction):
            argv.append(flag if value else "--no-" + flag.removeprefix("--"))
        elif action.nargs == 0:  # store_true
            argv.append(flag)
        elif action.nargs in ("+", "*"):
            argv += [flag, *map(str, value)]
        else:
            argv += [flag, str(value)]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--device", device, "--weight-version", weight_version]
    if served_model_name is not None:
        argv += ["--served-model-name", served_model_name]
    if peers:
        argv += ["--fleet-peer-urls", *peers]
    return argv


def _serve_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices["serve"]


def _die_with_parent() -> None:
    """Runs in each child before exec: the kernel sends it SIGTERM when the supervisor dies."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _spawn(argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    preexec = _die_with_parent if sys.platform.startswith("linux") else None
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL, preexec_fn=preexec,
                            env=None if env is None else settings.child_environ(env))


@dataclass
class Replica:
    index: int
    port: int
    device: str
    proc: subprocess.Popen | None = None
    restarts: int = 0
    given_up: bool = False
    peers: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def router_security_args(guard: ServeSecurity) -> list[str]:
    """sglang-router's flags for the fleet's first API key and its certificate (client
    certificates it cannot check: a ConfigError)."""
    if guard.ssl_cert_reqs:
        raise ConfigError("--ssl-cert-reqs: the fleet's router (sglang-router 0.3.2) does not check client "
                          "certificates; serve one replica, or check them in a proxy in front of the fleet")
    argv = ["--api-key", guard.api_keys[0]] if guard.api_keys else []
    if guard.tls:
        argv += ["--tls-cert-path", guard.ssl_certfile]
        argv += ["--tls-key-path", guard.ssl_keyfile] if guard.ssl_keyfile else []
    return argv


class Fleet:
    def __init__(self, args: argparse.Namespace, parser: argparse.ArgumentParser,
                 guard: ServeSecurity = ServeSecurity()) -> None:
        self.args = args
        self.parser = parser
        self.guard = guard
        self._router_security = router_security_args(guard)
        credential = guard.keys().fleet_credential
        self._poll_headers = {"authorization": f"Bearer {credential}"} if credential else {}
        n = args.data_parallel_size
        devices = replica_devices(args.device, n, args.tensor_parallel_size)
        self.replicas = [Replica(i, free_port(), devices[i]) for i in range(n)]
        for r in self.replicas:
            r.peers = [s.url for s in self.replicas if s is not r]
        self.router: subprocess.Popen | None = None
        self.stopping = threading.Event()

    # -- lifetime -------------------------------------------------------------------------
    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stopping.set())
        try:
            for r in self.replicas:
                self._start(r, self.args.model, self.args.weight_version, self.args.served_model_name)
            code = self._wait_replicas_healthy()
            if code is not None:
                return code
            self.router = _spawn(self._router_argv())
            logger.info("fleet of %d replicas (%s) behind sglang-router (cache_aware) on http://%s:%d; control calls "
                        "(pause, update, flush, abort, memory) sent to any replica reach all of them",
                        len(self.replicas), ", ".join(f"{r.url} on {r.device}" for r in self.replicas),
                        self.args.host, self.args.port)
            return self._supervise()
        finally:
            self._stop_all()

    def _start(self, r: Replica, model: str | None, weight_version: str, served_model_name: str | None) -> None:
        argv = replica_argv(self.parser, self.args, model=model, port=r.port, device=r.device, peers=r.peers,
                            weight_version=weight_version, served_model_name=served_model_name)
        r.proc = _spawn(argv, self.guard.key_environ())

    def _wait_replicas_healthy(self) -> int | None:
        """None once every replica answers /health; else the exit code the fleet should end with."""
        waiting = set(range(len(self.replicas)))
        while waiting:
            if self.stopping.is_set():
                return 0
            for i in sorted(waiting):
                r = self.replicas[i]
                code = r.proc.poll()
                if code is not None:
                    logger.error("replica %d (%s) exited with code %s while starting: stopping the fleet", i, r.url, code)
                    return code or 1
                if _healthy(r.url, self._poll_headers):
                    waiting.discard(i)
            self.stopping.wait(0.2)
        return None

    def _router_argv(self) -> list[str]:
        return [sys.executable, "-m", ROUTER_MODULE, "--host", self.args.host, "--port", str(self.args.port),
                "--worker-urls", *(r.url for r in self.replicas), "--policy", "cache_aware",
                "--health-check-interval-secs", str(ROUTER_HEALTH_INTERVAL_S),
                "--health-failure-threshold", str(ROUTER_HEALTH_FAILURES),
                "--log-level", _ROUTER_LOG_LEVELS[self.args.log_level], *self._router_security]

    def _supervise(self) -> int:
        while not self.stopping.wait(0.5):
            code = self.router.poll()
            if code is not None:
                logger.error("sglang-router exited with code %s: stopping the fleet", code)
                return code or 1
            for r in self.replicas:
                if not r.given_up and r.proc.poll() is not None:
                    self._replace(r)
        return 0

    def _replace(self, r: Replica) -> None:
        code = r.proc.returncode
        if r.restarts >= MAX_RESTARTS:
            r.given_up = True
            logger.error("replica %d (%s) exited with code %s after %d restarts: not restarting it again; the "
                         "router's health checks keep requests off it", r.index, r.url, code, r.restarts)
            return
        model, version, name = self._current_weights()
        r.restarts += 1
        logger.error("replica %d (%s) exited with code %s: restarting it (restart %d of %d) on weights %s "
                     "(weight_version %s); the router's health checks keep requests off it until it is up",
                     r.index, r.url, code, r.restarts, MAX_RESTARTS, model or "of the built-in model", version)
        self._start(r, model, version, name)

    def _current_weights(self) -> tuple[str | None, str, str | None]:
        """(checkpoint, weight version, model name) a live sibling serves now (after updates), else the start-up ones."""
        for s in self.replicas:
            if s.proc is not None and s.proc.poll() is None:
                try:
                    info = httpx.get(s.url + "/model_info", headers=self._poll_headers, timeout=5.0).json()
                except (httpx.HTTPError, ValueError):
                    continue
                return self._restartable(info)
        return self.args.model, self.args.weight_version, self.args.served_model_name

    def _restartable(self, info: dict) -> tuple[str | None, str, str]:
        """What a new replica can load to serve as its siblings do, from their /model_info."""
        path, version, name = info["model_path"], str(info["weight_version"]), info["served_model_name"]
        if path and Path(path, "config.json").is_file():
            return path, version, name
        if version == self.args.weight_version:  # never updated: the start-up weights
            return self.args.model, version, name
        logger.error("the fleet serves weights no checkpoint directory holds (weight_version %s: pushed by a "
                     "trainer, or a weights-only directory): the restarted replica serves the start-up weights "
                     "under weight_version %s until the next update", version, self.args.weight_version)
        return self.args.model, self.args.weight_version, name

    def _stop_all(self, timeout: float = 20.0) -> None:
        procs = [p for p in [self.router, *(r.proc for r in self.replicas)] if p is not None]
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("pid %d did not stop within %.0f s of SIGTERM: killing it", p.pid, timeout)
                p.kill()
                p.wait()


def _healthy(url: str, headers: dict[str, str]) -> bool:
    try:
        return httpx.get(url + "/health", headers=headers, timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def serve_fleet(args: argparse.Namespace, parser: argparse.ArgumentParser,
                guard: ServeSecurity = ServeSecurity()) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # the supervisor's health polls are not news
    if importlib.util.find_spec("sglang_router") is None:
        print("r3srv serve: --data-parallel-size > 1 runs the SGLang router in front of the replicas: "
              "pip install 'r3srv[router]' (sglang-router)", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    if args.fleet_peer_urls:
        print("r3srv serve: --fleet-peer-urls is set by --data-parallel-size itself; give one of them", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    try:
        fleet = Fleet(args, parser, guard)
    except ConfigError as exc:
        print(f"r3srv serve: configuration error: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    return fleet.run()
