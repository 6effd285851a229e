"""SGLang's native API: POST /generate, as SGLang-based RL rollouts (slime, miles, AReaL, verl's
SGLang backend) call it, and POST /abort_request (one rid, or abort_all, as those rollouts stop
over-sampled requests).

/generate takes one prompt (`text` or `input_ids`) or a batch (a list of either) and answers
one output object, or a list of them for a batch or n > 1 (prompt-major, as SGLang). Routed
experts are in meta_info, by default the way SGLang sends them (base64 of little-endian int32
rows, no header, every token of prompt + output but the last, from routed_experts_start_len on;
server/rows_encoding.py), and
meta_info echoes routed_experts_start_len on every answer (slime's multi-turn reads it back).
With stream=true it answers SGLang's server-sent events: `data: {...}` chunks whose text and
output_ids are cumulative, then `data: [DONE]`; routed experts come on each output's last chunk.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import AsyncIterator
from typing import Any

from litestar import MediaType, Request, Response, post
from litestar.params import JSONBody

from r3srv.offload import run_sized
from r3srv.outputs import CompletionOutput, Logprob, RequestOutput, SamplingMasks
from r3srv.server import protocol as p
from r3srv.server import rows_encoding
from r3srv.server.declare import Access, Fleet
from r3srv.server.fields import ROUTE_FIELDS
from r3srv.server.generation import Generation, ServerState, merged_outputs, start_all
from r3srv.server.images import expand
from r3srv.server.routes.common import run_to_end, server_state
from r3srv.server.sglang_meta import add_sampling_masks, meta_info
from r3srv.server.streaming import DONE, EngineStream, sse

ROUTE = "/generate"


@post(ROUTE, status_code=200, opt={"fields": ROUTE_FIELDS["sglang"]},
      summary="Generate for one prompt or a batch (SGLang's native API), routed experts in meta_info",
      access=Access.INFERENCE, fleet=Fleet.ONE_REPLICA)
async def sglang_generate(data: JSONBody[p.SglangGenerateRequest], request: Request[Any, Any, Any]) -> Any:
    state = server_state(request)
    prompts = await _token_ids(state, data.prompts())
    images = data.images(len(prompts))
    multimodal = []
    for i, refs in enumerate(images):  # placeholders expanded first: the room a prompt leaves counts them
        prompts[i], mm = await expand(state, prompts[i], refs, param="image_data" if not data.is_batch else
                                      f"image_data[{i}]", bare_base64=True)
        multimodal.append(mm)
    room = state.engine.max_model_len
    cap = state.engine.core.config.sampling_mask_max_tokens
    params = [data.to_sampling_params(i, room - len(prompt), cap) for i, prompt in enumerate(prompts)]
    request_ids = data.request_ids(len(prompts), uuid.uuid4().hex)
    loras = [data.lora(i) for i in range(len(prompts))]  # lora_path: the adapter's name, per prompt
    state.check_loras(loras, param="lora_path")
    if data.stream:
        gens = await start_all(state, ROUTE, prompts, params, request_ids, lora=loras, multimodal=multimodal)
        return EngineStream(_stream(state, data, request_ids, gens), gens)
    outs = await run_to_end(request, ROUTE, prompts, params, request_ids,
                            lambda finals: _answer(state, data, request_ids, finals), loras, multimodal=multimodal)
    return outs


async def _token_ids(state: ServerState, prompts: list[str | list[int]]) -> list[str | list[int]]:
    """Texts tokenized here (as the engine would), so each prompt's length is known before its
    max_new_tokens is clipped to the room its prompt leaves."""
    out: list[str | list[int]] = []
    for prompt in prompts:
        if isinstance(prompt, str):
            tokenizer = state.tokenizer()
            prompt = list(await run_sized(len(prompt), tokenizer.encode, prompt, add_special_tokens=True))
        out.append(prompt)
    return out


def _output_id(request_id: str, final: RequestOutput, c: CompletionOutput) -> str:
    return request_id if len(final.outputs) == 1 else f"{request_id}-{c.index}"


async def _answer(state: ServerState, req: p.SglangGenerateRequest, request_ids: list[str],
                  finals: list[RequestOutput]) -> Any:
    outs = [
        p.SglangGenerateOutput(
            text=c.text, output_ids=list(c.token_ids),
            meta_info=await _meta_info(state, req, i, _output_id(rid, final, c), final, c, c.token_ids, c.logprobs,
                                       True, c.sampling_mask),
        )
        for i, (rid, final) in enumerate(zip(request_ids, finals))
        for c in _as_asked(req, i, final.outputs)
    ]
    return outs[0] if len(outs) == 1 and not req.is_batch else outs


async def _meta_info(state: ServerState, req: p.SglangGenerateRequest, index: int, output_id: str,
                     out: RequestOutput, c: CompletionOutput, token_ids: list[int],
                     logprobs: list[dict[int, Logprob]] | None, final: bool,
                     masks: SamplingMasks | None) -> dict[str, Any]:
    """Output `c` of prompt `index`'s meta_info (`masks`: its tokens' sampling masks so far)."""
    return_logprob, _, top = req.logprobs_of(index)
    meta = await meta_info(
        state, output_id, out, c, token_ids, logprobs, final, start_len=req.routed_experts_start_len,
        logprobs_top=top if return_logprob else None, text_in_logprobs=req.return_text_in_logprobs,
        encoding=state.experts_encoding(req.routed_experts_encoding, rows_encoding.SGLANG_DEFAULT),
        weights_dtype=req.routed_expert_weights_dtype,
    )
    if masks is not None:
        want, mode, top_p_ids = req.sampling_mask_of(index)
        add_sampling_masks(meta, masks, token_ids, mode if want else None, top_p_ids)
    return meta


async def _stream(state: ServerState, req: p.SglangGenerateRequest, request_ids: list[str],
                  gens: list[Generation]) -> AsyncIterator[bytes]:
    """SGLang's default (non-incremental) stream: every chunk holds the output so far."""
    n = max(len(o.outputs) for o in (g.last for g in gens) if o is not None)
    indexed = req.is_batch or n > 1
    sofar: dict[tuple[int, int], tuple[str, list[int], list[dict[int, Logprob]], SamplingMasks | None]] = {}
    async for i, out in merged_outputs(gens):
        for c in _as_asked(req, i, out.outputs):
            text, ids, logprobs, masks = sofar.get((i, c.index), ("", [], [], None))
            if not c.text and not c.token_ids and not c.finished and (i, c.index) in sofar:
                continue
            text, ids, logprobs = text + c.text, ids + list(c.token_ids), logprobs + list(c.logprobs or [])
            if c.sampling_mask is not None:
                masks = c.sampling_mask if masks is None else masks.concat(c.sampling_mask)
            sofar[(i, c.index)] = (text, ids, logprobs, masks)
            meta = await _meta_info(state, req, i, _output_id(request_ids[i], out, c), out, c, ids, logprobs,
                                    c.finished, masks)
            yield sse(p.SglangGenerateOutput(text=text, output_ids=ids, meta_info=meta,
                                             index=i * n + c.index if indexed else None))
    yield DONE


def _as_asked(req: p.SglangGenerateRequest, index: int, outputs: list[CompletionOutput]) -> list[CompletionOutput]:
    """max_new_tokens=0 (prompt `index`): the one token the engine ran is left out, with its
    logprobs and the prompt's last row (rows cover every token but the last, now the prompt's)."""
    if not req.prefill_only(index):
        return outputs
    return [
        dataclasses.replace(c, text="", token_ids=[], logprobs=None if c.logprobs is None else [],
                            finish_reason=c.finish_reason and "length", stop_reason=None,
                            routed_experts=None if c.routed_experts is None else c.routed_experts[:-1],
                            routed_expert_weights=None if c.routed_expert_weights is None
                            else c.routed_expert_weights[:-1],
                            indexer_topk=None if c.indexer_topk is None else c.indexer_topk[:-1],
                            sampling_mask=None if c.sampling_mask is None else c.sampling_mask.head(0))
        for c in outputs
    ]



@post("/abort_request", status_code=200, media_type=MediaType.TEXT, summary="Abort one request by rid, or all in flight (SGLang)",
      access=Access.ADMIN, fleet=Fleet.EVERY_REPLICA)  # SGLang's auth level: ADMIN_OPTIONAL
async def sglang_abort_request(
    data: JSONBody[p.SglangAbortRequest], request: Request[Any, Any, Any]
) -> Response[bytes]:
    state = server_state(request)
    if data.abort_all:
        await state.abort_all()
    elif data.rid:
        await state.engine.abort(data.rid)
    # neither: nothing to abort, a 200 as SGLang answers it
    return Response(b"", status_code=200, media_type=MediaType.TEXT)
