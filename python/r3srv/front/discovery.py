"""What the fleet's URL answers about the fleet as a whole, from every replica's own answer.

- /health: 200 while at least one replica serves; 503 naming each replica's state otherwise.
- /server_info (/get_server_info): a replica's, with `dp_size` the fleet's and `internal_states`
  one entry per replica (as SGLang's data-parallel server lists one per DP rank): its `dp_rank`,
  URL, state, the requests the front has in flight there, weight_version, model_path, pause and
  memory state. `weight_version` is
  the replicas' common one, null while they differ (each entry says which serves what).
- /get_world_size (vLLM's): every replica's ranks added (each replica is a data-parallel rank of
  the fleet, as vLLM counts dp * tp * pp), one replica's with `include_dp=false`; SkyRL sizes its
  weight-sync group from it.
- /v1/loads and /get_load: one load per replica, `dp_rank` its index; `dp_rank=i` selects one.
- /get_weight_version: the common version; 409 naming each replica's while they differ.
- /metrics: every replica's samples summed series by series (the `_created` timestamps: the
  earliest), so a counter or gauge reads as it would on one server serving all of it.
- /workers and /list_workers (sglang-router's and older routers' worker lists): the fleet itself,
  as the one worker its client addressed. miles, pointed at the front as its router, sends its
  end-of-rollout `/abort_request` to each listed worker: to the front, which applies it on every
  replica.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, urlencode

import msgspec

from r3srv.server.errors import error_body
from r3srv.server.fanout import Reply, call, combine

if TYPE_CHECKING:
    from r3srv.front.app import Front

Answer = tuple[int, list[tuple[bytes, bytes]], bytes]
_JSON = [(b"content-type", b"application/json")]


def with_query(path: str, query: str) -> str:
    return path + (f"?{query}" if query else "")


def _json(status: int, payload: Any) -> Answer:
    return status, list(_JSON), msgspec.json.encode(payload)


async def ask_every_replica(front: Front, path: str, headers: list[tuple[bytes, bytes]]) -> list[Reply]:
    """GET `path` (query included) from every replica, in index order."""
    return list(await asyncio.gather(*(call(front.client, r.name, r.url + path, "GET", headers, b"")
                                       for r in front.replicas.replicas)))


def _decoded(reply: Reply) -> Any:
    try:
        return msgspec.json.decode(reply.body)
    except msgspec.DecodeError:
        return None


async def health(front: Front, path: str, query: str, headers: list[tuple[bytes, bytes]]) -> Answer:
    if front.replicas.up():
        return 200, [(b"content-type", b"text/plain")], b""
    states = ", ".join(f"{r.name}: {r.state.value}" for r in front.replicas.replicas)
    return _json(503, error_body(503, f"no replica of the fleet is serving ({states})"))


async def server_info(front: Front, path: str, query: str, headers: list[tuple[bytes, bytes]]) -> Answer:
    replies = await ask_every_replica(front, with_query(path, query), headers)
    if not any(r.ok for r in replies):
        return combine(path, replies)
    info, states = None, []
    for replica, reply in zip(front.replicas.replicas, replies):
        entry: dict[str, Any] = {"dp_rank": replica.index, "url": replica.url, "state": replica.state.value,
                                 "in_flight": front.in_flight[replica.index]}
        own = _decoded(reply) if reply.ok else None
        if isinstance(own, dict):
            info = info or own
            entry.update((own.get("internal_states") or [{}])[0])
            entry.update({k: own.get(k) for k in ("weight_version", "model_path", "is_paused")})
        else:
            entry["error"] = reply.why()
        states.append(entry)
    versions = {e["weight_version"] for e in states if "weight_version" in e}
    info.update(dp_size=len(states), internal_states=states,
                weight_version=versions.pop() if len(versions) == 1 else None)
    return _json(200, info)


_FALSE = {"false", "0", "no", "off", "f", "n"}  # a bool query parameter's false spellings


async def world_size(front: Front, path: str, query: str, headers: list[tuple[bytes, bytes]]) -> Answer:
    return fleet_world_size(path, query, await ask_every_replica(front, with_query(path, query), headers))


def fleet_world_size(path: str, query: str, replies: list[Reply]) -> Answer:
    """The fleet's /get_world_size from each replica's answer to the same query."""
    sizes = [_decoded(r) for r in replies if r.ok]
    if len(sizes) < len(replies) or not all(isinstance(s, dict) and "world_size" in s for s in sizes):
        return combine(path, replies)
    include_dp = [v for k, v in parse_qsl(query, keep_blank_values=True) if k == "include_dp"]
    if include_dp and include_dp[-1].lower() in _FALSE:
        return _json(200, sizes[0])
    return _json(200, {**sizes[0], "world_size": sum(s["world_size"] for s in sizes)})


def _dp_rank(front: Front, query: str) -> tuple[int | None, str, Answer | None]:
    """(the dp_rank asked for, the query without it, or a 400 naming it)."""
    pairs = parse_qsl(query, keep_blank_values=True)
    asked = [v for k, v in pairs if k == "dp_rank"]
    rest = urlencode([(k, v) for k, v in pairs if k != "dp_rank"])
    if not asked:
        return None, rest, None
    n = len(front.replicas.replicas)
    try:
        rank = int(asked[-1])
    except ValueError:
        rank = -1
    if not 0 <= rank < n:
        why = f"dp_rank {asked[-1]} does not exist: the fleet's ranks are 0..{n - 1}"
        return None, rest, _json(400, error_body(400, why, "dp_rank"))
    return rank, rest, None


async def loads(front: Front, path: str, query: str, headers: list[tuple[bytes, bytes]]) -> Answer:
    rank, rest, refused = _dp_rank(front, query)
    if refused:
        return refused
    replies = await ask_every_replica(front, with_query(path, rest), headers)
    if not any(r.ok for r in replies) or any(400 <= r.status < 500 for r in replies):
        return combine(path, replies)
    body, merged, accelerators = None, [], 0
    for replica, reply in zip(front.replicas.replicas, replies):
        own = _decoded(reply) if reply.ok else None
        if not isinstance(own, dict) or (rank is not None and rank != replica.index):
            continue
        body = body or own
        accelerators += own.get("num_accelerators") or 0
        merged += [{**load, "dp_rank": replica.index} for load in own.get("loads", [])]
    if body is None:
        return _json(503, error_body(503, f"replica {rank} is not serving: " + replies[rank].why()))
    return _json(200, {**body, "loads": merged, "num_accelerators": accelerators})


async def legacy_load(front: Front, path: str, query: str, headers: list[tuple[bytes, bytes]]) -> Answer:
    replies = await ask_every_replica(front, with_query(path, query), headers)
    if not any(r.ok for r in replies):
        return combine(path, replies)
    merged = []
    for replica, reply in zip(front.replicas.replicas, replies):
        own = _decoded(reply) if reply.ok else None
        if isinstance(own, list):
            merged += [{**load, "dp_rank": replica.index} for load in own]
    return _json(200, merged)


async def weight_version(front: Front, path: str, query: str, headers: list[tuple[bytes, bytes]]) -> Answer:
    replies = await ask_every_replica(front, with_query(path, query), headers)
    served = [(reply.name, _decoded(reply)) for reply in replies if reply.ok]
    if not served:
        return combine(path, replies)
    versions = {str(own.get("weight_version")) for _, own in served if isinstance(own, dict)}
    if len(versions) == 1:
        return _json(200, {"weight_version": served[0][1]["weight_version"]})
    return _json(409, error_body(409, "the replicas serve different weights: " + versions_by_replica(replies)))


def versions_by_replica(replies: list[Reply]) -> str:
    """'replica 0 (url): v1; replica 1 (url): unreachable ...' from /get_weight_version replies."""
    parts = []
    for reply in replies:
        own = _decoded(reply) if reply.ok else None
        parts.append(f"{reply.name}: {own['weight_version'] if isinstance(own, dict) else reply.why()}")
    return "; ".join(parts)


async def metrics(front: Front, path: str, query: str, headers: list[tuple[bytes, bytes]]) -> Answer:
    replies = await ask_every_replica(front, with_query(path, query), headers)
    texts = [reply.body.decode() for reply in replies if reply.ok]
    if not texts:
        return combine(path, replies)
    content_type = next(v for k, v in replies[[r.ok for r in replies].index(True)].headers if k.lower() == b"content-type")
    return 200, [(b"content-type", content_type)], sum_prometheus(texts).encode()


def sum_prometheus(texts: list[str]) -> str:
    """Prometheus text expositions of the same metrics, summed series by series (`_created`: the minimum).

    Families stay whole and in order (the format asks every sample of a family to follow its
    HELP and TYPE lines): a series that only a later text has joins its family's samples."""
    families: dict[str, tuple[list[str], dict[str, float]]] = {}
    for text in texts:
        family = None
        for line in text.splitlines():
            if not line:
                continue
            if line.startswith("# HELP "):
                family = line.split(" ", 3)[2]
                families.setdefault(family, ([], {}))
            if line.startswith("#"):
                comments = families.setdefault(family or "", ([], {}))[0]
                if line not in comments:
                    comments.append(line)
                continue
            series, value = line.rsplit(" ", 1)
            samples = families.setdefault(family or "", ([], {}))[1]
            number = float(value)
            if series in samples:
                before = samples[series]
                number = min(before, number) if _is_created(series) else before + number
            samples[series] = number
    lines = []
    for comments, samples in families.values():
        lines += comments
        lines += [f"{series} {_go_float(value)}" for series, value in samples.items()]
    return "\n".join(lines) + "\n"


def _is_created(series: str) -> bool:
    return series.split("{", 1)[0].endswith("_created")


def _go_float(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(value)


def fleet_url(scope: dict[str, Any]) -> str:
    """The fleet's URL as the client addressed it (its Host header, else the bound address)."""
    host = next((v.decode("latin-1") for k, v in scope["headers"] if k.lower() == b"host"), None)
    if host is None:
        server_host, server_port = scope.get("server") or ("127.0.0.1", 80)
        host = f"{server_host}:{server_port}"
    return f"{scope.get('scheme', 'http')}://{host}"


def workers(front: Front, url: str) -> Answer:
    return _json(200, {"workers": [{"id": url, "url": url, "model_id": None, "worker_type": "regular",
                                    "is_healthy": bool(front.replicas.up()), "load": sum(front.in_flight)}],
                       "total": 1, "stats": {"prefill_count": 0, "decode_count": 0, "regular_count": 1}})


def list_workers(front: Front, url: str) -> Answer:
    return _json(200, {"urls": [url]})


# Routers' worker lists: the fleet lists itself (its URL as the client addressed it).
SELF_ANSWERS: dict[str, Callable[[Front, str], Answer]] = {"/workers": workers, "/list_workers": list_workers}


FLEET_ANSWERS: dict[str, Callable[[Front, str, str, list[tuple[bytes, bytes]]], Awaitable[Answer]]] = {
    "/health": health,
    "/server_info": server_info,
    "/get_server_info": server_info,
    "/v1/loads": loads,
    "/get_load": legacy_load,
    "/get_weight_version": weight_version,
    "/get_world_size": world_size,
    "/metrics": metrics,
}
