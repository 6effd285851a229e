"""Helpers the route modules share: the server state, and running a request to its end."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from litestar import Request, Response

from r3srv.outputs import RequestOutput
from r3srv.sampling_params import SamplingParams
from r3srv.server.errors import error_response
from r3srv.server.generation import Generation, ServerState, close_all, start_all, until_disconnect

T = TypeVar("T")


def server_state(request: Request[Any, Any, Any]) -> ServerState:
    return request.app.state.server


async def run_to_end(
    request: Request[Any, Any, Any],
    route: str,
    prompts: list[str | list[int]],
    params: SamplingParams,
    request_id: str,
    build: Callable[[list[RequestOutput]], Awaitable[T]],
    lora: str | None | list[str | None] = None,
    multimodal: list | None = None,
) -> T | Response[bytes]:
    """Non-streaming: start every prompt, wait for the finished outputs, build the response.

    A client that disconnects first cancels the wait; `close_all` then aborts the
    engine requests, freeing their KV blocks.
    """
    state = server_state(request)
    gens: list[Generation] = []

    async def work() -> T:
        gens.extend(await start_all(state, route, prompts, params, request_id, stream=False, lora=lora,
                                    multimodal=multimodal))
        finals = await asyncio.gather(*(g.final() for g in gens))
        return await build(list(finals))

    try:
        result = await until_disconnect(request.receive, work())
    finally:
        await close_all(gens)
    if result is None:
        return error_response(400, "client disconnected before the response was ready")
    return result
