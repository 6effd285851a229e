"""POST /v1/completions and POST /v1/chat/completions."""

from __future__ import annotations

import uuid
from typing import Any

import msgspec
from litestar import Request, post
from litestar.params import JSONBody

from r3srv.errors import InvalidRequestError
from r3srv.offload import run_sized
from r3srv.server import protocol as p
from r3srv.server import rows_encoding
from r3srv.server.declare import Access, Fleet
from r3srv.server.fields import ROUTE_FIELDS
from r3srv.server.images import expand
from r3srv.server.generation import start_all
from r3srv.server.responses import chat_response, completion_response
from r3srv.server.routes.common import run_to_end, server_state
from r3srv.server.sglang_meta import meta_info
from r3srv.server.streaming import EngineStream, chat_stream, completion_stream
from r3srv.server.protocol.tools import check_tool_request


@post("/v1/completions", status_code=200, summary="Create a completion (OpenAI)", opt={"fields": ROUTE_FIELDS["completions"]},
      access=Access.INFERENCE, fleet=Fleet.ONE_REPLICA)
async def completions(data: JSONBody[p.CompletionRequest], request: Request[Any, Any, Any]) -> p.CompletionResponse:
    state = server_state(request)
    lora = state.check_model(data.model)  # an adapter's name selects it
    params = data.to_sampling_params()
    prompts = data.prompts()
    if not data.add_special_tokens:  # the engine tokenizes text with the tokenizer's specials
        tokenizer = state.tokenizer()
        prompts = [p if not isinstance(p, str) else
                   list(await run_sized(len(p), tokenizer.encode, p, add_special_tokens=False)) for p in prompts]
    request_id = data.request_id or f"cmpl-{uuid.uuid4().hex}"
    route = "/v1/completions"
    if data.stream:
        gens = await start_all(state, route, prompts, params, request_id, lora=lora)
        return EngineStream(completion_stream(state, data, request_id, gens), gens)  # type: ignore[return-value]
    return await run_to_end(  # type: ignore[return-value]
        request, route, prompts, params, request_id, lambda finals: completion_response(state, data, request_id, finals),
        lora,
    )


def _open_final_message(rendered: str, content: str | list[dict[str, Any]]) -> str:
    """The rendered conversation cut right after the last message's content, its turn left open
    for the reply to continue (transformers' continue_final_message, which vLLM uses). Content
    with images (a list of parts) is cut after its last text part, as transformers does."""
    if isinstance(content, list):
        content = next((part["text"] for part in reversed(content) if "text" in part), "")
    final = content.strip()
    at = rendered.rfind(final) if final else -1
    if at < 0:
        raise InvalidRequestError("continue_final_message: the chat template does not render the final message's "
                                  "content as it is", param="continue_final_message")
    return rendered[: at + len(final)]


@post("/v1/chat/completions", status_code=200, summary="Create a chat completion (OpenAI)",
      opt={"fields": ROUTE_FIELDS["chat"]},
      access=Access.INFERENCE, fleet=Fleet.ONE_REPLICA)
async def chat_completions(
    data: JSONBody[p.ChatCompletionRequest], request: Request[Any, Any, Any]
) -> p.ChatCompletionResponse:
    state = server_state(request)
    lora = state.check_model(data.model)  # an adapter's name selects it
    params = data.to_sampling_params()
    state.tokenizer()  # a 400 saying what to use instead when the checkpoint has none
    tool_choice = check_tool_request(data.tools, data.tool_choice, state.chat_parsers.tools_served)
    parsing = state.chat_parsers.for_request(data, tool_choice)
    if parsing is not None:  # the parsers read the markup, special tokens included (as vLLM's adjust_request)
        params = msgspec.structs.replace(params, skip_special_tokens=False)
    chat = state.engine.input_processor

    def render_and_encode() -> list[int]:
        rendered = chat.render_chat(data.template_messages(), data.generation_prompt, **data.template_kwargs())
        if data.continue_final_message:
            rendered = _open_final_message(rendered, data.template_messages()[-1]["content"])
        # The template writes its own specials (e.g. Mixtral's `{{ bos_token }}`): encoding them
        # again would double the BOS and shift every token and row, so none unless asked (as HF and vLLM).
        return list(state.tokenizer().encode(rendered, add_special_tokens=data.add_special_tokens))

    if data.input_ids is not None:  # SGLang's: the caller rendered the prompt itself
        prompt = list(data.input_ids)
    else:
        prompt = await run_sized(sum(m.content_chars() for m in data.messages), render_and_encode)
    # the messages' images fill the prompt's placeholders (one each, or each run already expanded)
    refs, fields = data.image_refs()
    prompt, images = await expand(state, prompt, refs, param="messages", fields=fields)
    request_id = data.request_id or f"chatcmpl-{uuid.uuid4().hex}"
    route = "/v1/chat/completions"
    if data.stream:
        gens = await start_all(state, route, [prompt], params, request_id, lora=lora, multimodal=[images])
        return EngineStream(chat_stream(state, data, request_id, gens, parsing), gens)  # type: ignore[return-value]

    async def build(finals: list[Any]) -> p.ChatCompletionResponse:
        response = await chat_response(state, data, request_id, finals[0], parsing)
        if data.return_meta_info:
            await _add_meta_info(state, data, request_id, finals[0], response)
        return response

    return await run_to_end(request, route, [prompt], params, request_id, build,  # type: ignore[return-value]
                            lora, multimodal=[images])


async def _add_meta_info(state: Any, data: p.ChatCompletionRequest, request_id: str, final: Any,
                         response: p.ChatCompletionResponse) -> None:
    """SGLang's return_meta_info: each choice carries /generate's meta_info (output_token_logprobs
    with the token texts when logprobs is on, routed experts in SGLang's int32 form)."""
    for choice, c in zip(response.choices, final.outputs):
        choice.meta_info = await meta_info(
            state, request_id, final, c, list(c.token_ids), c.logprobs, True,
            start_len=data.routed_experts_prompt_start, logprobs_top=(data.top_logprobs or 0) if data.logprobs else None,
            text_in_logprobs=True, encoding=rows_encoding.SGLANG_DEFAULT,
        )
