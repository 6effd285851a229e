"""SkyRL's POST /skyrl/v1/generate: token ids in, one choice out with its sampled logprobs and its
routed experts in SkyRL's `{data, shape, dtype}` form, as SkyRL's own vLLM server actor answers it."""

from __future__ import annotations

import math
import uuid
from typing import Any

from litestar import Request, post
from litestar.params import JSONBody

from r3srv.outputs import Logprob, RequestOutput
from r3srv.server import protocol as p
from r3srv.server.declare import Access, Fleet
from r3srv.server.fields import ROUTE_FIELDS
from r3srv.server.generation import ServerState
from r3srv.server.rows_encoding import SKYRL
from r3srv.server.routes.common import run_to_end, server_state

ROUTE = "/skyrl/v1/generate"
CLAMPED_LOGPROB = -9999.0  # SkyRL's floor for a missing or non-finite sampled logprob


@post(ROUTE, status_code=200, opt={"fields": ROUTE_FIELDS["skyrl"]},
      summary="Generate from token ids with routed experts in SkyRL's form (SkyRL's route)",
      access=Access.INFERENCE, fleet=Fleet.ONE_REPLICA)
async def skyrl_generate(
    data: JSONBody[p.SkyrlGenerateRequest], request: Request[Any, Any, Any]
) -> p.SkyrlGenerateResponse:
    state = server_state(request)
    lora = state.check_model(data.model)  # an adapter's name selects it, as on vLLM's routes
    params = data.to_sampling_params()
    request_id = uuid.uuid4().hex
    return await run_to_end(  # type: ignore[return-value]
        request, ROUTE, [list(data.token_ids)], params, request_id, lambda finals: _answer(state, finals[0]), lora
    )


def _sampled(token_ids: list[int], logprobs: list[dict[int, Logprob]]) -> p.SkyrlLogprobs:
    content = []
    for token, entry in zip(token_ids, logprobs):
        value = entry[token].logprob if entry and token in entry else None
        content.append(p.SkyrlLogprob(logprob=value if value is not None and math.isfinite(value) else CLAMPED_LOGPROB))
    return p.SkyrlLogprobs(content=content)


async def _answer(state: ServerState, final: RequestOutput) -> p.SkyrlGenerateResponse:
    c = final.outputs[0]
    return p.SkyrlGenerateResponse(choices=[p.SkyrlChoice(
        token_ids=list(c.token_ids),
        finish_reason=c.finish_reason,
        logprobs=_sampled(c.token_ids, c.logprobs) if c.logprobs is not None else None,
        routed_experts=await state.encode_experts(c.routed_experts, SKYRL),  # SkyRL's form has no start
    )])
