"""RL trainer endpoints: POST /update_weights_from_disk, /reset_prefix_cache,
/release_memory_occupation, /resume_memory_occupation, /pause_generation and
/continue_generation (GET /is_paused reads the state; GET or POST /flush_cache is SGLang's
name for /reset_prefix_cache).

Off unless the server starts with --enable-weight-updates: the first reads any directory the
server can, and all change what every later request gets. Names follow SGLang's
(/update_weights_from_disk, /release_memory_occupation, /resume_memory_occupation,
/pause_generation, /continue_generation) and vLLM's (/reset_prefix_cache, /is_paused), which
RL frameworks already call.
"""

from __future__ import annotations

import asyncio
import os
import stat
import time
from typing import Any

from litestar import HttpMethod, Request, get, post, route
from litestar.params import JSONBody

from r3srv.errors import ConfigError, InvalidRequestError, PermissionDeniedError
from r3srv.server import protocol as p
from r3srv.server.declare import Access, Fleet, Feature
from r3srv.server.confinement import confinement
from r3srv.server.routes.common import server_state


@post("/update_weights_from_disk", status_code=200, summary="Load new weights of the served architecture",
      access=Access.ADMIN, fleet=Fleet.EVERY_REPLICA, requires=Feature.WEIGHT_UPDATES)
async def update_weights_from_disk(
    data: JSONBody[p.UpdateWeightsFromDiskRequest], request: Request[Any, Any, Any]
) -> p.UpdateWeightsResponse:
    seconds = await update_weights_from_dir(
        request, data.model_path, abort_running=data.abort_all_requests, weight_version=data.weight_version
    )
    return p.UpdateWeightsResponse(
        success=True,
        message=f"loaded {data.model_path} in {seconds:.2f} s; prefix cache emptied",
        weight_version=server_state(request).engine.weight_version,
    )


async def update_weights_from_dir(
    request: Request[Any, Any, Any], path: str, *, param: str = "model_path", abort_running: bool = False,
    weight_version: str | None = None,
) -> float:
    """Load a checkpoint directory (or a directory of shards alone) into the served model,
    counted in the metrics; returns the seconds it took. A directory outside
    --allowed-weight-paths is a 403 naming `param` (server/confinement.py)."""
    state = server_state(request)
    counted = state.metrics.weight_updates
    start = time.perf_counter()
    try:
        path = await asyncio.to_thread(confinement(request).weight_paths.confine, path, param)
        await asyncio.to_thread(_check_checkpoint_dir, path, param)
        await state.engine.update_weights(path, abort_running=abort_running, weight_version=weight_version)
    except (ConfigError, InvalidRequestError, PermissionDeniedError) as exc:  # the client's to fix
        counted.labels("rejected").inc()
        if not isinstance(exc, ConfigError):
            raise
        raise InvalidRequestError(f"cannot load {path!r}: {exc}", param=param) from exc
    except Exception:
        counted.labels("failed").inc()
        raise
    seconds = time.perf_counter() - start
    counted.labels("loaded").inc()
    state.metrics.weight_update_seconds.observe(seconds)
    return seconds


def _check_checkpoint_dir(path: str, param: str) -> None:
    """A path the file system refuses (too long, a NUL byte, missing, no access) is the client's
    to fix, and is found before the engine touches a weight."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise InvalidRequestError(param=param, problem=f": cannot read {path[:256]!r}: {reason}") from None
    if not stat.S_ISDIR(mode):
        raise InvalidRequestError(param=param, problem=f": {path[:256]!r} is not a directory")


@post("/reset_prefix_cache", status_code=200, summary="Forget every cached prompt prefix",
      access=Access.ADMIN, fleet=Fleet.EVERY_REPLICA, requires=Feature.WEIGHT_UPDATES)
async def reset_prefix_cache(request: Request[Any, Any, Any]) -> p.ResetPrefixCacheResponse:
    return await _forget_prefixes(request)


@route("/flush_cache", http_method=[HttpMethod.GET, HttpMethod.POST], status_code=200,
       summary="Forget every cached prompt prefix (SGLang's name; RL frameworks GET or POST it)",
       access=Access.ADMIN, fleet=Fleet.EVERY_REPLICA, requires=Feature.WEIGHT_UPDATES)
async def flush_cache(request: Request[Any, Any, Any]) -> p.ResetPrefixCacheResponse:
    return await _forget_prefixes(request)


async def _forget_prefixes(request: Request[Any, Any, Any]) -> p.ResetPrefixCacheResponse:
    state = server_state(request)
    return p.ResetPrefixCacheResponse(success=True, num_blocks_forgotten=await state.engine.reset_prefix_cache())


@post("/release_memory_occupation", status_code=200, summary="Free the KV cache and/or move the weights to host memory",
      access=Access.ADMIN, fleet=Fleet.EVERY_REPLICA, requires=Feature.WEIGHT_UPDATES)
async def release_memory_occupation(
    data: JSONBody[p.MemoryOccupationRequest], request: Request[Any, Any, Any]
) -> p.MemoryOccupationResponse:
    state = server_state(request)
    released = await state.engine.release_memory(data.tags)
    return p.MemoryOccupationResponse(success=True, released=released)


@post("/resume_memory_occupation", status_code=200, summary="Take back what /release_memory_occupation gave up",
      access=Access.ADMIN, fleet=Fleet.EVERY_REPLICA, requires=Feature.WEIGHT_UPDATES)
async def resume_memory_occupation(
    data: JSONBody[p.MemoryOccupationRequest], request: Request[Any, Any, Any]
) -> p.MemoryOccupationResponse:
    state = server_state(request)
    released = await state.engine.resume_memory(data.tags)
    return p.MemoryOccupationResponse(success=True, released=released)


@post("/pause_generation", status_code=200, summary="Stop generating until /continue_generation (abort, retract or in place)",
      access=Access.ADMIN, fleet=Fleet.EVERY_REPLICA, requires=Feature.WEIGHT_UPDATES)
async def pause_generation(
    data: JSONBody[p.PauseGenerationRequest], request: Request[Any, Any, Any]
) -> p.PauseGenerationResponse:
    state = server_state(request)
    done = await state.engine.pause_generation(data.mode)
    return p.PauseGenerationResponse(success=True, mode=data.mode, num_aborted=done["aborted"],
                                     num_retracted=done["retracted"])


@post("/continue_generation", status_code=200, summary="Generate again after /pause_generation",
      access=Access.ADMIN, fleet=Fleet.EVERY_REPLICA, requires=Feature.WEIGHT_UPDATES)
async def continue_generation(request: Request[Any, Any, Any]) -> p.ContinueGenerationResponse:
    state = server_state(request)
    return p.ContinueGenerationResponse(success=True, was_paused=await state.engine.continue_generation())


@get("/is_paused", summary="Whether generation is paused, and how", access=Access.ADMIN, fleet=Fleet.ONE_REPLICA)
async def is_paused(request: Request[Any, Any, Any]) -> p.IsPausedResponse:
    mode = server_state(request).engine.paused
    return p.IsPausedResponse(is_paused=mode is not None, mode=mode)
