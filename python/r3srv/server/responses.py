"""Engine outputs -> response Structs (non-streaming), and the logprob formats of each API."""

from __future__ import annotations

import math
import time
from typing import Any, cast

import numpy as np
import msgspec
from msgspec import UNSET, UnsetType

from r3srv import serial
from r3srv.outputs import CompletionOutput, Logprob, RequestOutput, SamplingMasks
from r3srv.server import protocol as p
from r3srv.server import rows_encoding
from r3srv.server.chat_output import ChoiceParsing, finish_reason, message_fields
from r3srv.server.generation import ServerState


def usage_of(state: ServerState, outputs: list[RequestOutput], completion_tokens: int | None = None) -> p.UsageInfo:
    """Usage of finished outputs; a stream of DELTA outputs passes the tokens it counted.
    prompt_tokens_details only with --enable-prompt-tokens-details, as vLLM."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs) if completion_tokens is None else completion_tokens
    cached = None
    if state.options.enable_prompt_tokens_details:
        cached = p.PromptTokensDetails(cached_tokens=sum(o.num_cached_tokens for o in outputs))
    return p.UsageInfo(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion, prompt_tokens_details=cached
    )


class OpenAIRows:
    """Where an OpenAI response's routed experts go in the encoding asked: each choice's
    routed_experts, or (SGLang's encoding) the response's `sglext`, with the first choice's
    rows, as SGLang sends them."""

    def __init__(self, state: ServerState, req: p.CompletionRequest | p.ChatCompletionRequest) -> None:
        self.state = state
        self.encoding = state.experts_encoding(req.routed_experts_encoding, rows_encoding.OPENAI_DEFAULT)
        self.start = req.routed_experts_prompt_start
        self.in_sglext = self.encoding == "sglang"

    async def choice(self, rows: np.ndarray | None) -> str | None:
        return None if self.in_sglext else await self.state.encode_experts(rows, self.encoding, self.start)

    async def sglext(self, first_rows: np.ndarray | None) -> rows_encoding.SglExt | UnsetType:
        if not self.in_sglext or first_rows is None:
            return UNSET
        return rows_encoding.SglExt(routed_experts=await self.state.encode_experts(first_rows, "sglang"))


def ranked_logprobs(entry: dict[int, Logprob]) -> list[tuple[int, float]]:
    """(token id, logprob) pairs by descending logprob, ties to the lower id (the sampler's order)."""
    return sorted(((t, lp.logprob) for t, lp in entry.items()), key=lambda kv: (-kv[1], kv[0]))


def _value(entry: dict[int, Logprob], token_id: int, missing: float | None) -> float | None:
    lp = entry.get(token_id)
    return missing if lp is None else lp.logprob


_LOGPROB_FLOOR = -9999.0  # what vLLM sends for -inf (JSON has no infinity)


def floored(value: float) -> float:
    """A logprob as vLLM's OpenAI and TITO shapes send it: -inf (a token the processed modes
    filtered out, or a masked logit) and NaN as -9999.0."""
    return _LOGPROB_FLOOR if math.isnan(value) else max(value, _LOGPROB_FLOOR)


def _floored_ranked(entry: dict[int, Logprob]) -> list[tuple[int, float]]:
    return [(t, floored(v)) for t, v in ranked_logprobs(entry)]


def plain_prompt_logprobs(entries: list[dict[int, Logprob] | None]) -> list[dict[int, Logprob] | None]:
    """Prompt logprobs with -inf floored, as sampled tokens' entries (for echo's logprobs)."""
    return [None if e is None else {t: Logprob(floored(lp.logprob), lp.rank) for t, lp in e.items()}
            for e in entries]


def echo_prompt_text(tokenizer: Any, out: RequestOutput, with_token_ids: bool) -> str:
    """The prompt text echo puts first: the prompt as sent, token-id prompts decoded; none with
    return_token_ids (the ids carry it), as vLLM."""
    if with_token_ids:
        return ""
    if out.prompt is not None:
        return out.prompt
    return "" if tokenizer is None else tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False)


def _rank(entry: dict[int, Logprob], token_id: int) -> int:
    """The token's rank among the entry's tokens (what the HTTP routes have always sent)."""
    value = entry[token_id].logprob
    return 1 + sum(1 for lp in entry.values() if lp.logprob > value)


class LogprobFormatter:
    """Builds each API's logprob objects for a slice of a choice's tokens. `as_ids`: tokens as
    "token_id:<id>" (vLLM's return_tokens_as_token_ids), as they are without a tokenizer."""

    def __init__(self, tokenizer: Any, as_ids: bool = False) -> None:
        self._tokenizer = tokenizer
        self._as_ids = as_ids

    @classmethod
    def of(cls, state: ServerState, req: Any) -> LogprobFormatter:
        """The formatter for an OpenAI request: its return_tokens_as_token_ids, else the server's."""
        as_ids = getattr(req, "return_tokens_as_token_ids", None)
        return cls(state.engine.tokenizer, state.options.return_tokens_as_token_ids if as_ids is None else as_ids)

    def token_str(self, token_id: int) -> str:
        if self._tokenizer is None or self._as_ids:  # no tokenizer (token-id prompts), or asked for ids
            return f"token_id:{token_id}"
        return self._tokenizer.decode([token_id], skip_special_tokens=False)

    def completion(
        self, token_ids: list[int], logprobs: list[dict[int, Logprob] | None], text_offset: int
    ) -> p.CompletionLogProbs:
        """An entry of None (the first prompt token's, with echo) has no logprobs, as in vLLM."""
        out = p.CompletionLogProbs(text_offset=[], token_logprobs=[], tokens=[], top_logprobs=[])
        for tid, entry in zip(token_ids, logprobs):
            token = self.token_str(tid)
            out.text_offset.append(text_offset)
            text_offset += len(token)
            out.tokens.append(token)
            value = None if entry is None else _value(entry, tid, None)
            out.token_logprobs.append(None if value is None else floored(value))
            out.top_logprobs.append(None if entry is None else {self.token_str(t): v for t, v in _floored_ranked(entry)})
        return out

    def prompt_logprobs(self, entries: list[dict[int, Logprob] | None] | None) -> p.PromptLogprobs | None:
        """vLLM's prompt_logprobs: -inf as -9999.0 (its clamp_prompt_logprobs), token texts filled."""
        if entries is None:
            return None
        return [
            None if entry is None else {
                t: p.Logprob(logprob=floored(lp.logprob), rank=lp.rank, decoded_token=self.token_str(t))
                for t, lp in entry.items()
            }
            for entry in entries
        ]

    def chat(self, token_ids: list[int], logprobs: list[dict[int, Logprob]], top: int) -> p.ChatCompletionLogProbs:
        content = []
        for tid, entry in zip(token_ids, logprobs):
            token = self.token_str(tid)
            content.append(
                p.ChatCompletionLogProbsContent(
                    token=token,
                    logprob=floored(_value(entry, tid, float("-inf"))),
                    bytes=list(token.encode("utf-8")),
                    top_logprobs=[
                        p.ChatCompletionLogProb(token=(s := self.token_str(t)), logprob=v, bytes=list(s.encode("utf-8")))
                        for t, v in (_floored_ranked(entry) if top == -1 else _floored_ranked(entry)[:top])
                    ],
                )
            )
        return p.ChatCompletionLogProbs(content=content)


def _tokens_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob]]) -> p.GenerateLogProbs:
    content = [
        p.GenerateLogProbsContent(
            token_id=tid,
            logprob=floored(_value(entry, tid, float("-inf"))),
            rank=_rank(entry, tid) if tid in entry else None,
            top_logprobs=[p.GenerateLogProb(token_id=t, logprob=v, rank=r + 1)
                          for r, (t, v) in enumerate(_floored_ranked(entry))],
        )
        for tid, entry in zip(token_ids, logprobs)
    ]
    return p.GenerateLogProbs(content=content)


def tito_openai_logprobs(state: ServerState, req: p.GenerateRequest) -> bool:
    """Whether /inference/v1/generate answers OpenAI's logprob objects (the Text shapes): in text
    mode, as vLLM 0.33, and with --generate-logprobs-format openai in tokens mode too, as vLLM
    before output_mode (its clients read `token` as "token_id:<id>" under --return-tokens-as-token-ids)."""
    return req.output_mode == "text" or state.options.generate_logprobs_format == "openai"


def tito_logprobs(
    state: ServerState, req: p.GenerateRequest, token_ids: list[int], logprobs: list[dict[int, Logprob]]
) -> p.GenerateLogProbs | p.ChatCompletionLogProbs:
    if tito_openai_logprobs(state, req):
        return LogprobFormatter(state.engine.tokenizer, state.options.return_tokens_as_token_ids).chat(token_ids, logprobs, -1)
    return _tokens_logprobs(token_ids, logprobs)


def _logprobs(choice: CompletionOutput) -> list[dict[int, Logprob]]:
    return choice.logprobs or []


async def completion_response(
    state: ServerState, req: p.CompletionRequest, request_id: str, finals: list[RequestOutput]
) -> p.CompletionResponse:
    fmt = LogprobFormatter.of(state, req)
    with_ids = bool(req.return_token_ids)
    rows = OpenAIRows(state, req)
    choices = []
    for i, out in enumerate(finals):
        prompt_text = echo_prompt_text(state.engine.tokenizer, out, with_ids) if req.echo else ""
        prompt_logprobs = fmt.prompt_logprobs(out.prompt_logprobs)
        for c in out.outputs:
            token_ids, logprobs, text = c.token_ids, _logprobs(c), c.text
            if req.echo_only:  # max_tokens=0: the prompt alone, as vLLM
                token_ids, logprobs, text = [], [], ""
            if req.echo and req.logprobs is not None:  # the prompt's tokens and logprobs first
                token_ids = list(out.prompt_token_ids) + token_ids
                logprobs = plain_prompt_logprobs(out.prompt_logprobs or []) + logprobs
            choices.append(
                p.CompletionResponseChoice(
                    index=i * req.n + c.index,
                    text=prompt_text + text,
                    logprobs=fmt.completion(token_ids, logprobs, 0) if req.logprobs is not None else None,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    prompt_token_ids=list(out.prompt_token_ids) if with_ids else None,
                    token_ids=list(c.token_ids) if with_ids else None,
                    routed_experts=await rows.choice(c.routed_experts),
                    indexer_topk=indexer_topk(c),
                    weight_versions=vllm_weight_versions(c) if req.return_weight_versions else None,
                    weight_version=state.weight_version(out), **state.lora_fields(out),
                    prompt_logprobs=prompt_logprobs,
                )
            )
    return p.CompletionResponse(id=request_id, model=finals[0].lora_name or state.model_name, choices=choices, usage=usage_of(state, finals),
                                sglext=await rows.sglext(finals[0].outputs[0].routed_experts))


async def chat_response(
    state: ServerState, req: p.ChatCompletionRequest, request_id: str, final: RequestOutput,
    parsing: ChoiceParsing | None = None,
) -> p.ChatCompletionResponse:
    fmt = LogprobFormatter.of(state, req)
    hidden = parsing is not None and parsing.hide_metadata
    with_ids = bool(req.return_token_ids) and not hidden
    echoed = req.echoed_text()
    rows = OpenAIRows(state, req)
    choices = []
    for c in final.outputs:
        parser = parsing.new() if parsing is not None else None
        fields = message_fields(parser, c.text, echoed) if parser is not None else {"content": echoed + c.text}
        choices.append(p.ChatCompletionResponseChoice(
            index=c.index,
            message=p.ChatMessage(role=req.response_role(), **fields),
            logprobs=fmt.chat(c.token_ids, _logprobs(c), req.top_logprobs or 0) if req.logprobs and not hidden else None,
            finish_reason=finish_reason(c.finish_reason, bool(fields.get("tool_calls"))),
            stop_reason=c.stop_reason,
            token_ids=list(c.token_ids) if with_ids else None,
            routed_experts=await rows.choice(c.routed_experts),
            indexer_topk=indexer_topk(c),
            weight_versions=vllm_weight_versions(c) if req.return_weight_versions else None,
            weight_version=state.weight_version(final), **state.lora_fields(final),
        ))
    return p.ChatCompletionResponse(
        id=request_id,
        model=final.lora_name or state.model_name,  # an adapter's name, as vLLM answers
        choices=choices,
        usage=usage_of(state, [final]),
        prompt_token_ids=list(final.prompt_token_ids) if with_ids else None,
        prompt_logprobs=fmt.prompt_logprobs(final.prompt_logprobs),
        sglext=await rows.sglext(final.outputs[0].routed_experts),
        image_grid_thw=UNSET if final.image_grid_thw is None else [list(grid) for grid in final.image_grid_thw],
    )


def vllm_weight_versions(c: CompletionOutput) -> list[p.WeightVersionSpan] | None:
    """Which weights sampled which of `c`'s tokens (None until it has finished)."""
    if c.weight_versions is None:
        return None
    return [p.WeightVersionSpan(version=s.version, start=s.start, end=s.end) for s in c.weight_versions]


def tito_sampling_mask(masks: SamplingMasks | None) -> list[list[int]] | None:
    """vLLM's `sampling_mask`: a list of ids per token, ascending (a msgspec.Raw of the Rust
    core's JSON, which the response's encoder copies as it is)."""
    if masks is None:
        return None
    return cast(list[list[int]], msgspec.Raw(serial.encode_int_lists(masks.token_ids, masks.offsets)))


def expert_weights(c: CompletionOutput, dtype: str) -> dict[str, Any] | None:
    """`c`'s router weights as sent (None where they were not asked for)."""
    weights = c.routed_expert_weights
    return None if weights is None else serial.encode_expert_weights(weights, dtype)


def indexer_topk(c: CompletionOutput) -> str | UnsetType:
    """`c`'s indexer selections as vLLM sends them (base64 .npy int32), absent where not asked."""
    return UNSET if c.indexer_topk is None else serial.encode_routed_experts(c.indexer_topk)


def tito_rows_encoding(state: ServerState, req: p.GenerateRequest) -> str:
    return state.experts_encoding(req.routed_experts_encoding, rows_encoding.OPENAI_DEFAULT)


async def generate_response(
    state: ServerState, req: p.GenerateRequest, request_id: str, final: RequestOutput
) -> p.GenerateResponse | p.GenerateTextResponse:
    text_mode = req.output_mode == "text"
    encoding, start = tito_rows_encoding(state, req), req.sampling_params.routed_experts_prompt_start
    openai = tito_openai_logprobs(state, req)
    choice_type = p.GenerateTextChoice if openai else p.GenerateChoice
    response_type = p.GenerateTextResponse if openai else p.GenerateResponse
    choices = [
        choice_type(
            index=c.index,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
            token_ids=list(c.token_ids),
            logprobs=tito_logprobs(state, req, c.token_ids, c.logprobs) if c.logprobs is not None else None,
            routed_experts=await state.encode_experts(c.routed_experts, encoding, start),
            routed_expert_weights=expert_weights(c, req.routed_expert_weights_dtype),
            indexer_topk=indexer_topk(c),
            sampling_mask=tito_sampling_mask(c.sampling_mask),
            weight_versions=vllm_weight_versions(c),
            weight_version=state.weight_version(final), **state.lora_fields(final),
            text=c.text if text_mode else UNSET,
        )
        for c in final.outputs
    ]
    return response_type(
        request_id=request_id,
        model=final.lora_name or state.model_name,  # an adapter's name, as vLLM answers
        created=int(time.time()),
        output_mode=req.output_mode,
        choices=choices,
        usage=usage_of(state, [final]),
        prompt_logprobs=LogprobFormatter(state.engine.tokenizer).prompt_logprobs(final.prompt_logprobs),
        prompt_token_ids=list(final.prompt_token_ids) if req.return_token_ids else None,
        mm_placeholders=p.mm_placeholders(final.image_placeholders),
    )
