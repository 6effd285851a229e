"""The fleet's one URL: an ASGI app in front of N replicas, each a full `r3srv serve` on a private port.

Every request is read whole, then handled as its route declares (server/declare.py's `fleet=`),
so a route added later is served by its declaration alone:

- Fleet.ONE_REPLICA (generation, tokenizing, discovery): forwarded, body and answer unchanged,
  to the replica the prefix-aware policy picks (front/policy.py); every field of every dialect
  passes through by construction. A replica that cannot be reached is skipped for the next one.
- Fleet.EVERY_REPLICA (pause, continue, load from disk, flush, abort, memory): sent to every
  replica at once, one answer (server/fanout.py's `combine`); a partial failure names each
  replica that failed and says which weights each replica serves now.
- Fleet.OWN_RANK (joining a trainer's process group and receiving its broadcasts): sent to every
  replica at once, replica i joining as rank_offset + i * tp_size of the world the trainer
  opened (vLLM's and SGLang's data-parallel rule); the world is checked before anyone joins.
- a few discovery routes answer for the fleet as a whole (front/discovery.py).
A path no route declares is forwarded to one replica (which answers 404 or 405 as one server).

Keys: `keyed` puts server/auth.py's layer in front, reading the same route declarations
(`access=`) as one server, so the fleet's URL asks for the keys a replica asks for, before the
body is read. The client's headers travel with every forwarded call, its Authorization replaced
by the fleet's own credential (`credential`: the admin key, else an API key; the replicas have
the fleet's keys). With `--fleet-peer-urls` (the fronts of other nodes), every-replica calls also
reach those fronts, marked so that they go no further.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import httpx
import msgspec

from r3srv.front.discovery import FLEET_ANSWERS, SELF_ANSWERS, fleet_url, versions_by_replica
from r3srv.front.images import image_digests, image_references
from r3srv.front.policy import PrefixAwarePolicy, prompt_key
from r3srv.front.proxy import NOT_SENT, ReplicaFailed, forward, send_failure
from r3srv.front.replicas import ReplicaSet, State
from r3srv.server.auth import ApiKeys, Authenticate
from r3srv.server.declare import Fleet, Ranks, access_by_path
from r3srv.server.errors import error_body
from r3srv.server.generation import until_disconnect  # cancelling the forward closes the replica's connection
from r3srv.server.fanout import (
    FANOUT_HEADER, PEER_TIMEOUT, Reply, call, combine, forwarded_headers, marked, read_body, send_answer, send_json,
    target_path,
)
from r3srv.server.routes import ROUTE_HANDLERS
from r3srv.vision.media import MediaPolicy

logger = logging.getLogger("r3srv.fleet")

NO_REPLICA = 503
# Longer text prompts are tokenized off the event loop.
_ENCODE_INLINE_CHARS = 4096
# Pooled connections to the replicas are dropped before uvicorn's keep-alive (5 s) closes them.
_KEEPALIVE_S = 2.0


def declared_fleet(handlers: list[Any]) -> dict[str, Fleet]:
    """Each declared path's fleet behaviour."""
    return {path: h.opt["fleet"] for h in handlers for path in h.paths}


def declared_ranks(handlers: list[Any]) -> dict[str, Ranks]:
    """Each OWN_RANK path's rank numbering (server/declare.py's Ranks; the default where undeclared)."""
    return {path: h.opt.get("ranks", Ranks()) for h in handlers if h.opt["fleet"] is Fleet.OWN_RANK for path in h.paths}


class RankError(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def rank_bodies(body: bytes, replicas: int, tp_size: int, ranks: Ranks = Ranks()) -> list[bytes]:
    """The body of an OWN_RANK call for each replica: `rank_offset` (at the top level, or inside an
    object field such as vLLM's init_info) moved by i * tp_size for replica i. Bodies without one go
    to all unchanged. RankError when the world the trainer opened cannot hold every replica's ranks."""
    data = _json_or_none(body) if body else None
    holder = None
    if isinstance(data, dict):
        holder = data if "rank_offset" in data else next(
            (v for v in data.values() if isinstance(v, dict) and "rank_offset" in v), None)
    offset = _as_int(holder.get("rank_offset")) if holder is not None else None
    if offset is None:  # nothing to move (or not a number: each replica refuses it alike)
        return [body] * replicas
    world = _as_int(holder.get(ranks.world))
    count = replicas * tp_size
    if offset < ranks.lowest_offset:
        raise RankError(f"rank_offset must be at least {ranks.lowest_offset}"
                        f"{' (rank 0 is the trainer)' if ranks.lowest_offset == 1 else ''}, got {offset}", "rank_offset")
    if world is not None and offset + count > world:
        raise RankError(f"{ranks.world} {world} leaves no room for the fleet's {count} ranks ({replicas} replicas x "
                        f"{tp_size} tensor-parallel ranks): they join as ranks {offset}..{offset + count - 1}, so "
                        f"{ranks.world} must be at least {offset + count}", ranks.world)
    bodies = []
    for i in range(replicas):
        holder["rank_offset"] = offset + i * tp_size
        bodies.append(msgspec.json.encode(data))
    return bodies


def _as_int(value: Any) -> int | None:
    """An int as pydantic's lax mode reads one (1 or "1"), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().lstrip("+-").isdigit():
        return int(value)
    return None


class Front:
    def __init__(self, replicas: ReplicaSet, *, tp_size: int, block_size: int, max_body_bytes: int,
                 peer_urls: list[str] | None = None, encode: Callable[[str], list[int]] | None = None,
                 credential: str | None = None, media: MediaPolicy | None = None) -> None:
        self.replicas = replicas
        self.media = media or MediaPolicy()  # the replicas' media flags: the front reads the files they may read
        self.credential = credential
        self.encode = encode
        self.tp_size = tp_size
        self.max_body_bytes = max_body_bytes
        self.peer_urls = [u.rstrip("/") for u in peer_urls or ()]
        self.routes = declared_fleet(ROUTE_HANDLERS)
        self.ranks = declared_ranks(ROUTE_HANDLERS)
        self.policy = PrefixAwarePolicy(len(replicas.replicas), block_size)
        self.in_flight = [0] * len(replicas.replicas)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256, keepalive_expiry=_KEEPALIVE_S)
        self.client = httpx.AsyncClient(timeout=PEER_TIMEOUT, limits=limits)
        replicas.on_restart.append(lambda r: self.policy.forget(r.index))

    async def aclose(self) -> None:
        await self.client.aclose()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = await read_body(receive, self.max_body_bytes)
        if body is None:
            await send_json(send, 413, error_body(413, f"Request Entity Too Large: the body is over "
                                                       f"{self.max_body_bytes} bytes"))
            return
        path, headers = scope["path"], forwarded_headers(scope["headers"], credential=self.credential)
        listed = SELF_ANSWERS.get(path)
        if listed is not None:
            await send_answer(send, *listed(self, fleet_url(scope)))
            return
        answer = FLEET_ANSWERS.get(path)
        if answer is not None:
            await send_answer(send, *await answer(self, path, scope.get("query_string", b"").decode("latin-1"), headers))
            return
        kind = self.routes.get(path, Fleet.ONE_REPLICA)
        if kind is Fleet.ONE_REPLICA:
            await self.dispatch(scope, receive, send, headers, body)
        else:
            await send_answer(send, *await self.to_every_replica(scope, headers, body, kind))

    # -- one replica ----------------------------------------------------------------------
    async def dispatch(self, scope: dict[str, Any], receive: Any, send: Any, headers: list[tuple[bytes, bytes]],
                       body: bytes) -> None:
        hashes, images = await self._prefix(body) if body else ([], [])
        tried: set[int] = set()
        while True:
            candidates = [r.index for r in self.replicas.up() if r.index not in tried]
            if not candidates:
                states = ", ".join(f"{r.name}: {r.state.value}" for r in self.replicas.replicas)
                await send_json(send, NO_REPLICA, error_body(NO_REPLICA, f"no replica of the fleet can take this "
                                                                         f"request now ({states}): retry"))
                return
            i = self.policy.choose(hashes, candidates, self.in_flight, images)
            replica = self.replicas.replicas[i]
            self.policy.record(hashes + images, i)
            self.in_flight[i] += 1
            try:
                await until_disconnect(receive, forward(self.client, replica.url + target_path(scope), scope,
                                                        headers, body, send))
                return
            except NOT_SENT as exc:
                self.replicas.mark_down(replica, f"{type(exc).__name__}: {exc}")
                tried.add(i)
            except ReplicaFailed as exc:
                logger.warning("%s failed while serving %s: %s", replica.name, scope["path"], exc)
                await send_failure(send, replica.name, exc)
                return
            finally:
                self.in_flight[i] -= 1

    async def _prefix(self, body: bytes) -> tuple[list[int], list[int]]:
        """The prompt's blocks and its images' blocks (front/policy.py)."""
        data = _json_or_none(body)
        key = prompt_key(data)
        if key is not None and key[0] == "text" and self.encode is not None:
            text = key[1]
            key = "ids", await asyncio.to_thread(self.encode, text) if len(text) > _ENCODE_INLINE_CHARS else self.encode(text)
        references = image_references(data)
        digests = await asyncio.to_thread(image_digests, references, self.media) if references else []  # files, MBs
        return self.policy.block_hashes(key), self.policy.image_hashes(digests)

    # -- every replica --------------------------------------------------------------------
    async def to_every_replica(self, scope: dict[str, Any], headers: list[tuple[bytes, bytes]], body: bytes,
                               kind: Fleet) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        path, replicas = scope["path"], self.replicas.replicas
        if kind is Fleet.OWN_RANK:
            absent = [r.name for r in replicas if r.state is not State.UP]
            if absent:  # the trainer's group would wait for ranks that never come
                return _refusal(NO_REPLICA, f"{path}: every replica takes part with its own ranks, and "
                                            f"{', '.join(absent)} is not serving now: retry once /health says all are")
            try:
                bodies = rank_bodies(body, len(replicas), self.tp_size, self.ranks[path])
            except RankError as exc:
                return _refusal(400, str(exc), exc.param)
        else:
            bodies = [body] * len(replicas)
        sent = forwarded_headers(headers, (FANOUT_HEADER.encode(), b"1"))
        target = target_path(scope)
        peers = self.peer_urls if kind is Fleet.EVERY_REPLICA and not marked(scope) else []
        with self.replicas.control_call():
            replies: list[Reply] = list(await asyncio.gather(
                *(call(self.client, r.name, r.url + target, scope["method"], sent, b) for r, b in zip(replicas, bodies)),
                *(call(self.client, f"peer front {url}", url + target, scope["method"], sent, body) for url in peers),
            ))
        note = ""
        if any(r.ok for r in replies) and not all(r.ok for r in replies):
            versions = [await call(self.client, r.name, r.url + "/get_weight_version", "GET", headers, b"")
                        for r in replicas]
            note = f" (weights each replica serves now: {versions_by_replica(versions)})"
            logger.error("%s failed on part of the fleet%s", path, note)
        return combine(path, replies, note)


def keyed(front: Front, keys: ApiKeys) -> Any:
    """The front behind the key check of one server (nothing to check without keys)."""
    return Authenticate(front, keys, access_by_path(ROUTE_HANDLERS)) if keys.enabled else front


def _refusal(status: int, message: str, param: str | None = None) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    return status, [(b"content-type", b"application/json")], msgspec.json.encode(error_body(status, message, param))


def _json_or_none(body: bytes) -> Any:
    try:
        return msgspec.json.decode(body)
    except (msgspec.DecodeError, RecursionError):  # not JSON, or nested past msgspec's depth: no key
        return None
