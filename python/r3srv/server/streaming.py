"""Server-sent events: turn the engine's DELTA outputs into per-choice chunks.

Each chunk carries one choice's new text/tokens. The chunk with `finish_reason`
also carries that choice's whole `routed_experts` (no other chunk does). Usage
comes last when `stream_options.include_usage` is set, then `data: [DONE]`.
The response object closes every engine request when the stream ends for any
reason, including a client that disconnects mid-stream.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import anyio
import msgspec
from litestar.response import Stream
from litestar.response.streaming import ASGIStreamingResponse
from litestar.types import Receive, Send
from msgspec import UNSET, UnsetType

from r3srv.errors import InvalidRequestError, R3srvError
from r3srv.outputs import CompletionOutput, Logprob, RequestOutput
from r3srv.server import protocol as p
from r3srv.server.chat_output import ChoiceParsing, delta_fields, finish_reason
from r3srv.server.errors import error_body
from r3srv.server.generation import Generation, ServerState, close_all, merged_outputs
from r3srv.server.responses import (
    LogprobFormatter,
    OpenAIRows,
    echo_prompt_text,
    expert_weights,
    indexer_topk,
    plain_prompt_logprobs,
    tito_logprobs,
    tito_openai_logprobs,
    tito_rows_encoding,
    tito_sampling_mask,
    usage_of,
    vllm_weight_versions,
)

logger = logging.getLogger("r3srv.server")
_encode = msgspec.json.Encoder().encode
DONE = b"data: [DONE]\n\n"
SSE_MEDIA_TYPE = "text/event-stream"


def sse(chunk: msgspec.Struct) -> bytes:
    # One join, not two `+`: a final chunk holds megabytes of routed experts, copied once.
    return b"".join((b"data: ", _encode(chunk), b"\n\n"))


async def _guarded(content: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Headers are already sent mid-stream, so an error becomes a last OpenAI-shaped error event."""
    try:
        async for chunk in content:
            yield chunk
    except Exception as exc:  # CancelledError (a disconnect) is a BaseException and passes through
        if isinstance(exc, InvalidRequestError):
            status = 400
        elif isinstance(exc, R3srvError):
            status = 503
        else:
            status = 500
            logger.exception("error while streaming")
        yield sse(error_body(status, f"{type(exc).__name__}: {exc}", getattr(exc, "param", None)))
        yield DONE
    finally:
        await content.aclose()  # type: ignore[attr-defined]


class _EngineASGIStream(ASGIStreamingResponse):
    __slots__ = ("gens",)

    def __init__(self, *, gens: list[Generation], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.gens = gens

    async def send_body(self, send: Send, receive: Receive) -> None:
        try:
            await super().send_body(send, receive)
        finally:
            # Runs on normal end, on client disconnect (Litestar cancels the sender)
            # and on errors: close our generator, then abort what is still running.
            with anyio.CancelScope(shield=True):
                aclose = getattr(self.iterator, "aclose", None)
                if aclose is not None:
                    await aclose()
                await close_all(self.gens)


class EngineStream(Stream):
    """A text/event-stream response that always closes its engine requests, even on disconnect."""

    __slots__ = ("_gens",)

    def __init__(self, content: AsyncIterator[bytes], gens: list[Generation]) -> None:
        super().__init__(_guarded(content), media_type=SSE_MEDIA_TYPE, status_code=200, headers={"Cache-Control": "no-cache"})
        self._gens = gens

    def to_asgi_response(  # type: ignore[override]
        self, app: Any, request: Any, *, headers: dict[str, str] | None = None, cookies: Any = None, **kwargs: Any
    ) -> ASGIStreamingResponse:
        # Litestar's Stream would take the handler's media type (JSON) over ours.
        return _EngineASGIStream(
            gens=self._gens,
            iterator=self.iterator,
            background=self.background or kwargs.get("background"),
            content_length=0,
            cookies=self.cookies if cookies is None else [*self.cookies, *cookies],
            encoded_headers=kwargs.get("encoded_headers"),
            encoding=self.encoding,
            headers={**headers, **self.headers} if headers is not None else self.headers,
            is_head_response=kwargs.get("is_head_response", False),
            media_type=SSE_MEDIA_TYPE,
            status_code=200,
        )


@dataclass
class _Delta:
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    text_offset: int  # characters of this choice sent before this delta
    first: bool
    final: bool


class _Tracker:
    """Per (prompt, choice) of DELTA outputs: started or not, finished or not, characters and tokens sent."""

    def __init__(self) -> None:
        self._sent: dict[tuple[int, int], tuple[int, int]] = {}  # (characters, tokens)
        self._done: set[tuple[int, int]] = set()

    def delta(self, prompt_index: int, c: CompletionOutput) -> _Delta | None:
        key = (prompt_index, c.index)
        if key in self._done:
            return None
        first = key not in self._sent
        n_text, n_tok = self._sent.get(key, (0, 0))
        final = c.finished
        if not c.text and not c.token_ids and not final and not first:
            return None
        self._sent[key] = (n_text + len(c.text), n_tok + len(c.token_ids))
        if final:
            self._done.add(key)
        return _Delta(c.text, c.token_ids, c.logprobs, n_text, first, final)

    def started(self, prompt_index: int, c: CompletionOutput) -> bool:
        return (prompt_index, c.index) in self._sent

    @property
    def num_tokens(self) -> int:
        return sum(n_tok for _, n_tok in self._sent.values())

    def usage(self, prompt_index: int, choice: int, out: RequestOutput) -> p.UsageInfo:
        """vLLM's continuous usage: the prompt, and the tokens this choice has sent so far."""
        prompt = len(out.prompt_token_ids)
        sent = self._sent.get((prompt_index, choice), (0, 0))[1]
        return p.UsageInfo(prompt_tokens=prompt, completion_tokens=sent, total_tokens=prompt + sent)


def _continuous(stream_options: p.StreamOptions | None) -> bool:
    return stream_options is not None and stream_options.continuous


async def completion_stream(
    state: ServerState, req: p.CompletionRequest, request_id: str, gens: list[Generation]
) -> AsyncIterator[bytes]:
    created = int(time.time())
    fmt = LogprobFormatter.of(state, req)
    with_ids = bool(req.return_token_ids)
    continuous = _continuous(req.stream_options)
    tracker = _Tracker()
    rows = OpenAIRows(state, req)
    first_rows = None
    finals: dict[int, RequestOutput] = {}
    model = state.model_name
    async for i, out in merged_outputs(gens):
        model = out.lora_name or state.model_name  # an adapter's name, as vLLM answers
        # echo: each choice's first chunk starts with the prompt (and its logprobs), as vLLM's
        prompt_text = echo_prompt_text(state.engine.tokenizer, out, with_ids) if req.echo else ""
        for c in out.outputs:
            if not (req.echo or c.text or c.token_ids or c.finished or tracker.started(i, c)):
                continue  # a choice with nothing yet (n > 1: a sibling's step) opens no chunk, as vLLM's
            d = tracker.delta(i, c)
            if d is None:
                continue
            text, token_ids, logprobs, offset = d.text, d.token_ids, d.logprobs or [], d.text_offset + len(prompt_text)
            if req.echo_only:  # max_tokens=0: the prompt alone, as vLLM
                text, token_ids, logprobs = "", [], []
            if req.echo and d.first:
                text, offset = prompt_text + text, 0
                if req.logprobs is not None:
                    token_ids = list(out.prompt_token_ids) + token_ids
                    logprobs = plain_prompt_logprobs(out.prompt_logprobs or []) + logprobs
            choice = p.CompletionResponseStreamChoice(
                index=i * req.n + c.index,
                text=text,
                logprobs=fmt.completion(token_ids, logprobs, offset) if req.logprobs is not None else None,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
                prompt_token_ids=list(out.prompt_token_ids) if with_ids and d.first else UNSET,
                token_ids=d.token_ids if with_ids else UNSET,
                routed_experts=await rows.choice(c.routed_experts) if d.final else UNSET,
                indexer_topk=indexer_topk(c) if d.final else UNSET,
                weight_versions=vllm_weight_versions(c) if d.final and req.return_weight_versions else UNSET,
                weight_version=state.weight_version(out) if d.final else UNSET,
                **(state.lora_fields(out) if d.final else {}),
            )
            if d.final and i == c.index == 0:
                first_rows = c.routed_experts
            usage = tracker.usage(i, c.index, out) if continuous else None
            yield sse(p.CompletionStreamResponse(
                id=request_id, created=created, model=model, choices=[choice], usage=usage))
        if out.finished:
            finals[i] = out
    if (sglext := await rows.sglext(first_rows)) is not UNSET:  # SGLang's: a chunk of its own
        yield sse(p.CompletionStreamResponse(id=request_id, created=created, model=model, choices=[],
                                             sglext=sglext))
    if req.stream_options and req.stream_options.include_usage:
        usage = usage_of(state, list(finals.values()), tracker.num_tokens)
        yield sse(p.CompletionStreamResponse(id=request_id, created=created, model=model, choices=[], usage=usage))
    yield DONE


async def chat_stream(
    state: ServerState, req: p.ChatCompletionRequest, request_id: str, gens: list[Generation],
    parsing: ChoiceParsing | None = None,
) -> AsyncIterator[bytes]:
    created = int(time.time())
    fmt = LogprobFormatter.of(state, req)
    hidden = parsing is not None and parsing.hide_metadata
    with_ids = bool(req.return_token_ids) and not hidden
    with_logprobs = bool(req.logprobs) and not hidden
    parsers = {} if parsing is not None else None  # one per choice
    continuous = _continuous(req.stream_options)
    role, echoed = req.response_role(), req.echoed_text()
    tracker = _Tracker()
    rows = OpenAIRows(state, req)
    first_rows = None
    final: RequestOutput | None = None
    sent_prompt_ids = False
    grids_unsent = [True]  # the images' grids ride on the stream's first chunk
    model = state.model_name

    def chunk(
        choice: p.ChatCompletionResponseStreamChoice, prompt_ids: list[int] | None, out: RequestOutput,
        opening: bool = False,
    ) -> bytes:
        usage = None
        grids: list[list[int]] | UnsetType = UNSET
        if grids_unsent[0] and out.image_grid_thw is not None:
            grids, grids_unsent[0] = [list(grid) for grid in out.image_grid_thw], False
        if continuous:  # the role and echo chunks come before any generated token
            usage = tracker.usage(0, choice.index, out)
            if opening:
                usage.completion_tokens, usage.total_tokens = 0, usage.prompt_tokens
        return sse(
            p.ChatCompletionStreamResponse(
                id=request_id,
                created=created,
                model=out.lora_name or state.model_name,  # an adapter's name, as vLLM answers
                choices=[choice],
                prompt_token_ids=prompt_ids if prompt_ids is not None else UNSET,
                usage=usage,
                image_grid_thw=grids,
            )
        )

    async for _, out in merged_outputs(gens):
        model = out.lora_name or state.model_name
        for c in out.outputs:
            d = tracker.delta(0, c)
            if d is None:
                continue
            prompt_ids = None
            if with_ids and not sent_prompt_ids:
                prompt_ids, sent_prompt_ids = list(out.prompt_token_ids), True
            if d.first:  # OpenAI opens each choice with the role (then vLLM's echo, if any)
                opening = p.ChatCompletionResponseStreamChoice(index=c.index, delta=p.DeltaMessage(role=role, content=""))
                yield chunk(opening, prompt_ids, out, opening=True)
                if echoed:
                    echo = p.ChatCompletionResponseStreamChoice(index=c.index, delta=p.DeltaMessage(content=echoed))
                    yield chunk(echo, None, out, opening=True)
                prompt_ids = None
                if not d.text and not d.token_ids and not d.final:
                    continue
            reason = c.finish_reason
            if parsers is not None:
                parser = parsers.setdefault(c.index, parsing.new())  # type: ignore[union-attr]
                fields = delta_fields(parser.finish(d.text) if d.final else parser.feed(d.text))
                reason = finish_reason(c.finish_reason, parser.called_tools)
                if not fields and not d.final and not with_logprobs and not with_ids:
                    continue  # markup so far, nothing to show yet
                delta = p.DeltaMessage(**fields)
            else:
                delta = p.DeltaMessage(content=d.text) if d.text or not d.final else p.DeltaMessage()
            choice = p.ChatCompletionResponseStreamChoice(
                index=c.index,
                delta=delta,
                logprobs=fmt.chat(d.token_ids, d.logprobs or [], req.top_logprobs or 0) if with_logprobs else None,
                finish_reason=reason,
                stop_reason=c.stop_reason,
                token_ids=d.token_ids if with_ids else UNSET,
                routed_experts=await rows.choice(c.routed_experts) if d.final else UNSET,
                indexer_topk=indexer_topk(c) if d.final else UNSET,
                weight_versions=vllm_weight_versions(c) if d.final and req.return_weight_versions else UNSET,
                weight_version=state.weight_version(out) if d.final else UNSET,
                **(state.lora_fields(out) if d.final else {}),
            )
            if d.final and c.index == 0:
                first_rows = c.routed_experts
            yield chunk(choice, prompt_ids, out)
        if out.finished:
            final = out
    if (sglext := await rows.sglext(first_rows)) is not UNSET:  # SGLang's: a chunk of its own
        yield sse(p.ChatCompletionStreamResponse(id=request_id, created=created, model=model, choices=[],
                                                 sglext=sglext))
    if req.stream_options and req.stream_options.include_usage and final is not None:
        usage = usage_of(state, [final], tracker.num_tokens)
        yield sse(p.ChatCompletionStreamResponse(id=request_id, created=created, model=model, choices=[], usage=usage))
    yield DONE


async def generate_stream(
    state: ServerState, req: p.GenerateRequest, request_id: str, gens: list[Generation]
) -> AsyncIterator[bytes]:
    text_mode = req.output_mode == "text"
    encoding, start = tito_rows_encoding(state, req), req.sampling_params.routed_experts_prompt_start
    openai = tito_openai_logprobs(state, req)
    choice_type = p.GenerateTextStreamChoice if openai else p.GenerateStreamChoice
    response_type = p.GenerateTextStreamResponse if openai else p.GenerateStreamResponse
    tracker = _Tracker()
    final: RequestOutput | None = None
    sent_prompt_ids = False
    async for _, out in merged_outputs(gens):
        for c in out.outputs:
            d = tracker.delta(0, c)
            if d is None:
                continue
            prompt_ids = None
            if req.return_token_ids and not sent_prompt_ids:
                prompt_ids, sent_prompt_ids = list(out.prompt_token_ids), True
            choice = choice_type(
                index=c.index,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
                token_ids=d.token_ids,
                logprobs=tito_logprobs(state, req, d.token_ids, d.logprobs) if d.logprobs is not None else None,
                routed_experts=await state.encode_experts(c.routed_experts, encoding, start) if d.final else UNSET,
                indexer_topk=indexer_topk(c) if d.final else UNSET,
                routed_expert_weights=(expert_weights(c, req.routed_expert_weights_dtype) or UNSET) if d.final else UNSET,
                sampling_mask=tito_sampling_mask(c.sampling_mask),
                weight_versions=vllm_weight_versions(c) if d.final else UNSET,
                weight_version=state.weight_version(out) if d.final else UNSET,
                **(state.lora_fields(out) if d.final else {}),
                text=d.text if text_mode else UNSET,
            )
            yield sse(
                response_type(
                    request_id=request_id, output_mode=req.output_mode, choices=[choice], prompt_token_ids=prompt_ids,
                    mm_placeholders=None if prompt_ids is None else p.mm_placeholders(out.image_placeholders),
                    usage=tracker.usage(0, c.index, out) if _continuous(req.stream_options) else None,
                )
            )
        if out.finished:
            final = out
    if req.stream_options and req.stream_options.include_usage and final is not None:
        yield sse(p.GenerateStreamResponse(request_id=request_id, output_mode=req.output_mode, choices=[], usage=usage_of(state, [final], tracker.num_tokens)))
    yield DONE
