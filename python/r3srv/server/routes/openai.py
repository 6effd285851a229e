"""POST /v1/completions and POST /v1/chat/completions."""

from __future__ import annotations

import uuid
from typing import Any

import msgspec
from litestar import Request, post

from r3srv.offload import run_sized
from r3srv.server import protocol as p
from r3srv.server.declare import Access, Fleet
from r3srv.server.fields import ROUTE_FIELDS
from r3srv.server.generation import start_all
from r3srv.server.responses import chat_response, completion_response
from r3srv.server.routes.common import run_to_end, server_state
from r3srv.server.streaming import EngineStream, chat_stream, completion_stream
from r3srv.server.protocol.tools import check_tool_request


@post("/v1/completions", status_code=200, summary="Create a completion (OpenAI)", opt={"fields": ROUTE_FIELDS["completions"]},
      access=Access.INFERENCE, fleet=Fleet.ONE_REPLICA)
async def completions(data: p.CompletionRequest, request: Request[Any, Any, Any]) -> p.CompletionResponse:
    state = server_state(request)
    state.check_model(data.model)
    params = data.to_sampling_params()
    prompts = data.prompts()
    request_id = data.request_id or f"cmpl-{uuid.uuid4().hex}"
    route = "/v1/completions"
    if data.stream:
        gens = await start_all(state, route, prompts, params, request_id)
        return EngineStream(completion_stream(state, data, request_id, gens), gens)  # type: ignore[return-value]
    return await run_to_end(  # type: ignore[return-value]
        request, route, prompts, params, request_id, lambda finals: completion_response(state, data, request_id, finals)
    )


@post("/v1/chat/completions", status_code=200, summary="Create a chat completion (OpenAI)",
      opt={"fields": ROUTE_FIELDS["chat"]},
      access=Access.INFERENCE, fleet=Fleet.ONE_REPLICA)
async def chat_completions(data: p.ChatCompletionRequest, request: Request[Any, Any, Any]) -> p.ChatCompletionResponse:
    state = server_state(request)
    state.check_model(data.model)
    params = data.to_sampling_params()
    state.tokenizer()  # a 400 saying what to use instead when the checkpoint has none
    tool_choice = check_tool_request(data.tools, data.tool_choice, state.chat_parsers.tools_served)
    parsing = state.chat_parsers.for_request(data, tool_choice)
    if parsing is not None:  # the parsers read the markup, special tokens included (as vLLM's adjust_request)
        params = msgspec.structs.replace(params, skip_special_tokens=False)
    chat = state.engine.input_processor

    def render_and_encode() -> list[int]:
        return chat.chat_prompt_ids(data.template_messages(), data.add_generation_prompt, **data.template_kwargs())

    prompt = await run_sized(sum(m.content_chars() for m in data.messages), render_and_encode)
    request_id = data.request_id or f"chatcmpl-{uuid.uuid4().hex}"
    route = "/v1/chat/completions"
    if data.stream:
        gens = await start_all(state, route, [prompt], params, request_id)
        return EngineStream(chat_stream(state, data, request_id, gens, parsing), gens)  # type: ignore[return-value]
    return await run_to_end(  # type: ignore[return-value]
        request, route, [prompt], params, request_id,
        lambda finals: chat_response(state, data, request_id, finals[0], parsing),
    )
