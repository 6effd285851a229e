"""vLLM's token-in/token-out scale-out API: POST /inference/v1/generate and /inference/v1/abort_requests."""

from __future__ import annotations

import uuid
from typing import Any

from litestar import MediaType, Request, Response, post
from litestar.params import JSONBody

from r3srv.server import protocol as p
from r3srv.server.declare import Access, Fleet
from r3srv.server.fields import ROUTE_FIELDS
from r3srv.server.generation import start_all
from r3srv.server.images import expand
from r3srv.server.responses import generate_response
from r3srv.server.routes.common import run_to_end, server_state
from r3srv.server.streaming import EngineStream, generate_stream


@post("/inference/v1/generate", status_code=200, summary="Generate from token ids (vLLM scale-out)",
      opt={"fields": ROUTE_FIELDS["tito"]},
      access=Access.INFERENCE, fleet=Fleet.ONE_REPLICA)
async def generate(
    data: JSONBody[p.GenerateRequest], request: Request[Any, Any, Any]
) -> p.GenerateResponse | p.GenerateTextResponse:
    state = server_state(request)
    lora = state.check_model(data.model)  # an adapter's name selects it
    params = data.to_sampling_params()
    request_id = data.request_id or uuid.uuid4().hex
    route = "/inference/v1/generate"
    refs, fields = data.image_refs()
    ids, images = await expand(state, list(data.token_ids), refs, param="content_parts", fields=fields)
    prompts: list[str | list[int]] = [ids]
    if data.stream:
        gens = await start_all(state, route, prompts, params, request_id, lora=lora, multimodal=[images])
        return EngineStream(generate_stream(state, data, request_id, gens), gens)  # type: ignore[return-value]
    return await run_to_end(  # type: ignore[return-value]
        request, route, prompts, params, request_id, lambda finals: generate_response(state, data, request_id, finals[0]),
        lora, multimodal=[images],
    )


@post("/inference/v1/abort_requests", status_code=200, media_type=MediaType.TEXT, summary="Abort requests by request_id (vLLM scale-out)",
      access=Access.INFERENCE, fleet=Fleet.EVERY_REPLICA)
async def abort_requests(data: JSONBody[p.AbortRequestsRequest], request: Request[Any, Any, Any]) -> Response[bytes]:
    engine = server_state(request).engine
    for request_id in data.request_ids:
        await engine.abort(request_id)
    return Response(b"", status_code=200, media_type=MediaType.TEXT)
