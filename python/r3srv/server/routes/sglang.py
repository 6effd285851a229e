"""SGLang's native API: POST /generate for one prompt (text or input_ids), as SGLang-based RL
rollouts (slime, miles, verl's SGLang backend) call it, with the routed experts in meta_info
the way SGLang sends them (base64 of little-endian int32 rows, no header, every token of
prompt + output but the last from routed_experts_start_len on), not streamed here; and POST
/abort_request (one rid, or abort_all, as those rollouts stop over-sampled requests)."""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

from litestar import MediaType, Request, Response, post
from msgspec import UNSET

from r3srv.errors import InvalidRequestError
from r3srv.outputs import CompletionOutput, RequestOutput
from r3srv.server import protocol as p
from r3srv.server.generation import ServerState
from r3srv.server.responses import ranked_logprobs
from r3srv.server.routes.common import run_to_end, server_state

ROUTE = "/generate"


@post(ROUTE, status_code=200, summary="Generate for one prompt (SGLang's native API), routed experts in meta_info")
async def sglang_generate(data: p.SglangGenerateRequest, request: Request[Any, Any, Any]) -> Any:
    state = server_state(request)
    if data.stream:
        raise InvalidRequestError("stream=true is not served on /generate: stream /v1/completions or "
                                  "/inference/v1/generate instead", param="stream")
    request_id = data.rid or uuid.uuid4().hex
    prompt: str | list[int] = data.text if data.input_ids is None else list(data.input_ids)
    try:
        return await run_to_end(request, ROUTE, [prompt], data.to_sampling_params(), request_id,
                                lambda finals: _outputs(state, data, request_id, finals[0]))
    except InvalidRequestError as exc:  # the engine names the field as SamplingParams does
        sglang_name = _SGLANG_NAMES.get(exc.param or "")
        if sglang_name is not None:
            raise InvalidRequestError(str(exc).replace(exc.param, sglang_name), param=sglang_name) from None
        raise


# SamplingParams' names of the fields SGLang names otherwise
_SGLANG_NAMES = {"routed_experts_prompt_start": "routed_experts_start_len", "prompt_logprobs_start": "logprob_start_len",
                 "max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens", "cache_salt": "extra_key"}


async def _outputs(state: ServerState, req: p.SglangGenerateRequest, request_id: str, final: RequestOutput):
    """One output object, or a list of them with sampling_params.n > 1 (as SGLang answers)."""
    version = state.weight_version(final)
    outs = []
    for c in final.outputs:
        if req.prefill_only:
            c = _without_the_generated_token(c)
        meta: dict[str, Any] = {
            "id": request_id if len(final.outputs) == 1 else f"{request_id}-{c.index}",
            "finish_reason": _finish_reason(c),
            "prompt_tokens": len(final.prompt_token_ids),
            "completion_tokens": len(c.token_ids),
            "cached_tokens": final.num_cached_tokens,
        }
        if req.return_logprob:
            _add_logprobs(meta, req, final, c)
        if c.routed_experts is not None:
            meta["routed_experts"] = await state.encode_experts_raw_int32(c.routed_experts)
        if version is not UNSET:
            meta["weight_version"] = version
        outs.append(p.SglangGenerateOutput(text=c.text, output_ids=list(c.token_ids), meta_info=meta))
    return outs[0] if len(outs) == 1 else outs


def _without_the_generated_token(c: CompletionOutput) -> CompletionOutput:
    """max_new_tokens=0: the one token the engine ran is left out, with its logprobs and the
    prompt's last row (rows cover every token but the last, and the last is now the prompt's)."""
    rows = c.routed_experts
    return dataclasses.replace(c, text="", token_ids=[], logprobs=None if c.logprobs is None else [],
                               finish_reason="length", stop_reason=None,
                               routed_experts=None if rows is None else rows[:-1])


def _add_logprobs(meta: dict[str, Any], req: p.SglangGenerateRequest, final: RequestOutput, c: CompletionOutput) -> None:
    """SGLang's logprob keys: [logprob, token id, None] triples; the input ones from
    logprob_start_len on, the first of them without a logprob (as SGLang sends them)."""
    entries = final.prompt_logprobs or []
    inputs = final.prompt_token_ids[len(final.prompt_token_ids) - len(entries):]
    meta["input_token_logprobs"] = [[None if e is None else e[t].logprob, t, None] for t, e in zip(inputs, entries)]
    meta["output_token_logprobs"] = [[entry[t], t, None] for t, entry in zip(c.token_ids, c.logprobs or [])]
    meta["output_token_logprobs_length"] = len(c.token_ids)
    k = req.top_logprobs_num
    if k:
        meta["input_top_logprobs"] = [
            None if e is None else [[lp.logprob, t, None] for t, lp in sorted(e.items(), key=lambda kv: kv[1].rank)[:k]]
            for e in entries
        ]
        meta["output_top_logprobs"] = [[[v, t, None] for t, v in ranked_logprobs(entry)[:k]] for entry in c.logprobs or []]


def _finish_reason(c: CompletionOutput) -> dict[str, Any]:
    """SGLang's finish_reason objects."""
    if c.finish_reason == "length":
        return {"type": "length", "length": len(c.token_ids)}
    if c.finish_reason == "stop":  # a stop string, a stop token, or EOS (the last token)
        last = c.token_ids[-1] if c.token_ids else None
        return {"type": "stop", "matched": c.stop_reason if c.stop_reason is not None else last}
    return {"type": "abort", "message": "aborted"}


@post("/abort_request", status_code=200, summary="Abort one request by rid, or all in flight (SGLang)")
async def sglang_abort_request(data: p.SglangAbortRequest, request: Request[Any, Any, Any]) -> Response[bytes]:
    state = server_state(request)
    if data.abort_all:
        await state.abort_all()
    elif data.rid:
        await state.engine.abort(data.rid)
    else:
        raise InvalidRequestError("give a rid, or abort_all=true", param="rid")
    return Response(b"", status_code=200, media_type=MediaType.TEXT)
