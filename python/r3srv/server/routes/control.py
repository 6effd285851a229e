"""The RL control plane beyond updates and pauses: SGLang's weight-update session, vLLM's sleep
mode, world size and collective_rpc.

SGLang 0.5.23 (entrypoints/http_server.py): POST /begin_weight_update {selector},
/end_weight_update {} (miles brackets every update with them). vLLM 0.33: GET /get_world_size
(rl/online/api_router.py), and, in its development mode only, POST /sleep?level=&mode=,
/wake_up?tags=, GET /is_sleeping (serve/dev/sleep) and POST /collective_rpc (serve/dev/rpc):
r3srv serves those behind --enable-sleep-mode and --enable-collective-rpc, with the methods of
engine/rpc.py's table only.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Annotated, Any

from litestar import Request, get, post
from litestar.params import JSONBody, QueryParameter

from r3srv.engine import rpc
from r3srv.engine import sleep as sleep_mode
from r3srv.errors import InvalidRequestError
from r3srv.server.declare import Access, Feature, Fleet
from r3srv.server.protocol import weight_sync as w
from r3srv.server.routes.common import server_state
from r3srv.server.routes.weight_sync import trainer_updates

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------- SGLang's session
# Paired with the process-group calls between them, which each replica takes on its own.


@post("/begin_weight_update", status_code=200, summary="Open a weight-update session (SGLang's)",
      access=Access.ADMIN, fleet=Fleet.OWN_RANK, requires=Feature.WEIGHT_UPDATES)
async def begin_weight_update(
    data: JSONBody[w.BeginWeightUpdateRequest], request: Request[Any, Any, Any]
) -> w.SglangResult:
    await trainer_updates(request).begin_session(data.selector)
    return w.SglangResult(success=True, message="Success")


@post("/end_weight_update", status_code=200, summary="Close the weight-update session (SGLang's)",
      access=Access.ADMIN, fleet=Fleet.OWN_RANK, requires=Feature.WEIGHT_UPDATES)
async def end_weight_update(
    data: JSONBody[w.EndWeightUpdateRequest], request: Request[Any, Any, Any]
) -> w.SglangResult:
    await trainer_updates(request).end_session()
    return w.SglangResult(success=True, message="Success")


# ---------------------------------------------------------------- vLLM's


@get("/get_world_size", summary="Ranks of this server, for a trainer's group (vLLM's)",
     access=Access.ADMIN, fleet=Fleet.ONE_REPLICA, requires=Feature.WEIGHT_UPDATES)
async def get_world_size(
    request: Request[Any, Any, Any], include_dp: Annotated[bool, QueryParameter(name="include_dp")] = True,
) -> w.WorldSize:
    parallel = server_state(request).engine.config.parallel
    ranks = parallel.tensor_parallel_size * parallel.pipeline_parallel_size
    return w.WorldSize(world_size=ranks * parallel.data_parallel_size if include_dp else ranks)


@post("/sleep", status_code=200, summary="Pause, and at level 1 or 2 release the KV cache and weights (vLLM's)",
      access=Access.ADMIN, fleet=Fleet.EVERY_REPLICA, requires=Feature.SLEEP_MODE)
async def sleep(
    request: Request[Any, Any, Any],
    level: Annotated[int, QueryParameter(name="level")] = 1,
    mode: Annotated[str, QueryParameter(name="mode")] = "abort",
) -> w.SleepStatus:
    await sleep_mode.sleep(server_state(request).engine, level, mode)
    return w.SleepStatus(status="sleeping", level=level)


@post("/wake_up", status_code=200, summary="Take back what /sleep released; resume once awake (vLLM's)",
      access=Access.ADMIN, fleet=Fleet.EVERY_REPLICA, requires=Feature.SLEEP_MODE)
async def wake_up(
    request: Request[Any, Any, Any], tags: Annotated[list[str] | None, QueryParameter(name="tags")] = None,
) -> w.WakeStatus:
    tags = tags or None  # vLLM: no tags wakes everything
    awake = await sleep_mode.wake_up(server_state(request).engine, tags)
    return w.WakeStatus(status="awake" if awake else "sleeping", tags=tags)


@get("/is_sleeping", summary="Whether /sleep (or /pause) holds the engine (vLLM's)",
     access=Access.ADMIN, fleet=Fleet.ONE_REPLICA, requires=Feature.SLEEP_MODE)
async def is_sleeping(request: Request[Any, Any, Any]) -> w.IsSleeping:
    return w.IsSleeping(is_sleeping=sleep_mode.is_sleeping(server_state(request).engine))


@post("/collective_rpc", status_code=200, summary="A weight-sync method of r3srv's fixed table (vLLM's route)",
      access=Access.ADMIN, fleet=Fleet.OWN_RANK, requires=Feature.COLLECTIVE_RPC)
async def collective_rpc(
    data: JSONBody[w.CollectiveRpcRequest], request: Request[Any, Any, Any]
) -> w.CollectiveRpcResult:
    call = asyncio.ensure_future(rpc.collective_rpc(trainer_updates(request), data.method, data.args, data.kwargs))
    if data.timeout is None:
        return w.CollectiveRpcResult(results=await call)
    try:  # vLLM's timeout bounds the wait, not the work: the call goes on, as vLLM's workers do
        results = await asyncio.wait_for(asyncio.shield(call), data.timeout)
    except asyncio.TimeoutError:
        call.add_done_callback(_log_late_failure)
        raise InvalidRequestError(f"{data.method} did not finish within {data.timeout} s; it goes on",
                                  param="timeout") from None
    return w.CollectiveRpcResult(results=results)


def _log_late_failure(call: asyncio.Future) -> None:
    if not call.cancelled() and call.exception() is not None:
        logger.error("a collective_rpc call that outlived its timeout failed: %s", call.exception())
