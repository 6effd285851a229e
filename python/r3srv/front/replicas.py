"""The replica processes of a fleet: started, watched and restarted from the front's event loop.

Each replica is a child `r3srv serve` on a private 127.0.0.1 port. Children are spawned from the
event loop's thread, the process's main thread: the kernel sends them SIGTERM when the thread
that forked them dies (PR_SET_PDEATHSIG), so a front killed outright leaves no orphans.

A replica is UP (the front dispatches to it), DOWN (exited, or unreachable: the front keeps
requests off it) or STARTING. One that exits is restarted on the weights its siblings serve now
(their /model_info), at most MAX_RESTARTS times.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from r3srv import settings
from r3srv.net import bound_socket

logger = logging.getLogger("r3srv.fleet")

MAX_RESTARTS = 5
WATCH_INTERVAL_S = 0.5
# /health of an UP replica is read this often (a dead engine answers 503 before its process exits)
HEALTH_INTERVAL_S = 2.0
STOP_TIMEOUT_S = 20.0


class State(enum.Enum):
    STARTING = "starting"
    UP = "up"
    DOWN = "down"


def _die_with_parent() -> None:
    """Runs in each child before exec: the kernel sends it SIGTERM when its parent thread dies."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def spawn(argv: list[str], environ: dict[str, str] | None = None, pass_fds: tuple[int, ...] = ()) -> subprocess.Popen:
    """`environ`: variables set for the child on top of this process's (the fleet's keys);
    `pass_fds`: descriptors it inherits (its bound socket)."""
    preexec = _die_with_parent if sys.platform.startswith("linux") else None
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL, preexec_fn=preexec, pass_fds=pass_fds,
                            env=None if environ is None else settings.child_environ(environ))


@dataclass
class Replica:
    index: int
    port: int
    device: str
    proc: subprocess.Popen | None = None
    state: State = State.STARTING
    restarts: int = 0
    given_up: bool = False
    last_exit: int | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def name(self) -> str:
        return f"replica {self.index} ({self.url})"

    def exited(self) -> bool:
        return self.proc is None or self.proc.poll() is not None


# (model, weight_version, served_model_name) -> the replica's command line
ArgvFor = Callable[[Replica, "str | None", str, "str | None"], list[str]]


class ReplicaSet:
    def __init__(self, replicas: list[Replica], argv_for: ArgvFor, *, model: str | None, weight_version: str,
                 served_model_name: str | None, headers: dict[str, str] | None = None,
                 environ: dict[str, str] | None = None) -> None:
        self.replicas = replicas
        self.environ = environ  # set in each replica's environment (its keys: never on its command line)
        self.argv_for = argv_for
        self.startup = (model, weight_version, served_model_name)
        self.headers = headers or {}  # the supervisor's own calls (credentials, when the replicas need them)
        self.on_restart: list[Callable[[Replica], None]] = []
        self.stopping = False
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(5.0), headers=self.headers)
        self._control_calls = 0
        self._no_control_call = asyncio.Event()
        self._no_control_call.set()

    def up(self) -> list[Replica]:
        return [r for r in self.replicas if r.state is State.UP]

    # -- start-up -------------------------------------------------------------------------
    def start_all(self) -> None:
        for r in self.replicas:
            self._start(r, *self.startup)

    def _start(self, r: Replica, model: str | None, version: str, name: str | None) -> None:
        """The supervisor binds the replica's port and hands the socket over: a port picked free
        and bound later by the replica could be taken meanwhile (the replica would exit, or another
        server would answer at its URL). Its own copy closes once the child holds it."""
        r.state = State.STARTING
        try:
            sock = bound_socket("127.0.0.1", r.port)  # a restart binds the port it had
        except OSError as exc:
            if not r.port:
                raise
            logger.warning("%s: its port was taken while it was down (%s): restarting it on another", r.name, exc)
            sock = bound_socket("127.0.0.1", 0)
        with sock:
            r.port = sock.getsockname()[1]
            argv = self.argv_for(r, model, version, name) + ["--listen-fd", str(sock.fileno())]
            r.proc = spawn(argv, self.environ, pass_fds=(sock.fileno(),))

    async def wait_all_up(self, stop: asyncio.Event) -> int | None:
        """None once every replica answers /health; else the exit code the fleet should end with."""
        while any(r.state is not State.UP for r in self.replicas):
            if stop.is_set():
                return 0
            for r in self.replicas:
                if r.state is State.UP:
                    continue
                if r.exited():
                    logger.error("%s exited with code %s while starting: stopping the fleet", r.name, r.proc.returncode)
                    return r.proc.returncode or 1
                if await self._healthy(r):
                    r.state = State.UP
            try:
                await asyncio.wait_for(stop.wait(), 0.2)
            except asyncio.TimeoutError:
                pass
        return None

    async def _healthy(self, r: Replica) -> bool:
        try:
            return (await self._client.get(r.url + "/health", timeout=2.0)).status_code == 200
        except httpx.HTTPError:
            return False

    @contextlib.contextmanager
    def control_call(self) -> Iterator[None]:
        """Around a call sent to every replica: a replica restarted meanwhile waits for it to end
        before reading the weights its siblings serve (an update in flight would change them)."""
        self._control_calls += 1
        self._no_control_call.clear()
        try:
            yield
        finally:
            self._control_calls -= 1
            if not self._control_calls:
                self._no_control_call.set()

    # -- supervision ----------------------------------------------------------------------
    def mark_down(self, r: Replica, why: str) -> None:
        """The front could not reach it: no more requests until its /health answers again."""
        if r.state is State.UP:
            logger.warning("%s is unreachable (%s): requests go to the others until it answers /health", r.name, why)
            r.state = State.DOWN

    async def supervise(self) -> None:
        ticks_per_health = max(1, round(HEALTH_INTERVAL_S / WATCH_INTERVAL_S))
        tick = 0
        while not self.stopping:
            await asyncio.sleep(WATCH_INTERVAL_S)
            tick += 1
            for r in self.replicas:
                if self.stopping or r.given_up:
                    continue
                if r.exited():
                    await self._replace(r)
                elif r.state is not State.UP or tick % ticks_per_health == 0:
                    healthy = await self._healthy(r)
                    if healthy and r.state is State.STARTING and r.restarts:
                        await self._catch_up(r)
                    if healthy and r.state is not State.UP:
                        logger.info("%s is up", r.name)
                    elif not healthy and r.state is State.UP:
                        logger.warning("%s fails /health: requests go to the others", r.name)
                    r.state = State.UP if healthy else (State.DOWN if r.state is State.UP else r.state)

    async def _replace(self, r: Replica) -> None:
        code = r.last_exit = r.proc.returncode
        r.state = State.DOWN
        for callback in self.on_restart:
            callback(r)
        if r.restarts >= MAX_RESTARTS:
            r.given_up = True
            logger.error("%s exited with code %s after %d restarts: not restarting it again; the front keeps "
                         "requests off it", r.name, code, r.restarts)
            return
        model, version, name = await self._current_weights(r)
        if self.stopping:
            return
        r.restarts += 1
        logger.error("%s exited with code %s: restarting it (restart %d of %d) on weights %s (weight_version %s); "
                     "the front keeps requests off it until it is up", r.name, code, r.restarts, MAX_RESTARTS,
                     model or "of the built-in model", version)
        self._start(r, model, version, name)

    async def _catch_up(self, r: Replica) -> None:
        """A restarted replica pauses if its siblings are paused (it holds no request: abort is every mode)."""
        for s in self.replicas:
            if s is r or s.state is not State.UP:
                continue
            try:
                sibling = (await self._client.get(s.url + "/is_paused")).json()
                if sibling.get("is_paused"):
                    await self._client.post(r.url + "/pause_generation", json={"mode": "abort"})
                    logger.warning("%s paused, as %s is (mode %s): /continue_generation resumes the fleet", r.name,
                                   s.name, sibling.get("mode"))
            except (httpx.HTTPError, ValueError, AttributeError):
                continue
            return

    async def _current_weights(self, r: Replica) -> tuple[str | None, str, str | None]:
        """(checkpoint, weight version, model name) a live sibling serves once no control call is under
        way (after updates), else the start-up ones."""
        await self._no_control_call.wait()
        for s in self.replicas:
            if s is r or s.exited():
                continue
            try:
                info = (await self._client.get(s.url + "/model_info")).json()
            except (httpx.HTTPError, ValueError):
                continue
            if isinstance(info, dict) and "model_path" in info:
                return self._restartable(info)
        return self.startup

    def _restartable(self, info: dict[str, Any]) -> tuple[str | None, str, str]:
        """What a new replica can load to serve as its siblings do, from their /model_info."""
        model, start_version, _ = self.startup
        path, version, name = info["model_path"], str(info["weight_version"]), info["served_model_name"]
        if path and Path(path, "config.json").is_file():
            return path, version, name
        if version == start_version:  # never updated: the start-up weights
            return model, version, name
        logger.error("the fleet serves weights no checkpoint directory holds (weight_version %s: pushed by a "
                     "trainer, or a weights-only directory): the restarted replica serves the start-up weights "
                     "under weight_version %s until the next update", version, start_version)
        return model, start_version, name

    # -- shutdown -------------------------------------------------------------------------
    async def stop_all(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM every replica (each aborts its requests in flight, so open streams end), then wait;
        SIGKILL what is left after `timeout`. Called again, it only waits for the same."""
        self.stopping = True
        procs = [r.proc for r in self.replicas if r.proc is not None]
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while any(p.poll() is None for p in procs) and loop.time() < deadline:
            await asyncio.sleep(0.1)
        for p in procs:
            if p.poll() is None:
                logger.warning("pid %d did not stop within %.0f s of SIGTERM: killing it", p.pid, timeout)
                p.kill()
                p.wait()
        if not self._client.is_closed:
            await self._client.aclose()
