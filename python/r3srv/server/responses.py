"""Engine outputs -> response Structs (non-streaming), and the logprob formats of each API."""

from __future__ import annotations

import time
from typing import Any

from msgspec import UNSET

from r3srv.outputs import CompletionOutput, RequestOutput
from r3srv.server import protocol as p
from r3srv.server.generation import ServerState


def usage_of(state: ServerState, outputs: list[RequestOutput], completion_tokens: int | None = None) -> p.UsageInfo:
    """Usage of finished outputs; a stream of DELTA outputs passes the tokens it counted.
    prompt_tokens_details only with --enable-prompt-tokens-details, as vLLM."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs) if completion_tokens is None else completion_tokens
    cached = None
    if state.enable_prompt_tokens_details:
        cached = p.PromptTokensDetails(cached_tokens=sum(o.num_cached_tokens for o in outputs))
    return p.UsageInfo(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion, prompt_tokens_details=cached
    )


def ranked_logprobs(entry: dict[int, float]) -> list[tuple[int, float]]:
    # descending logprob, ties to the lower id (the sampler's order)
    return sorted(entry.items(), key=lambda kv: (-kv[1], kv[0]))


def _rank(entry: dict[int, float], token_id: int) -> int:
    value = entry[token_id]
    return 1 + sum(1 for v in entry.values() if v > value)


class LogprobFormatter:
    """Builds each API's logprob objects for a slice of a choice's tokens."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def token_str(self, token_id: int) -> str:
        if self._tokenizer is None:  # token-id prompts on a model without a tokenizer
            return f"token_id:{token_id}"
        return self._tokenizer.decode([token_id], skip_special_tokens=False)

    def completion(
        self, token_ids: list[int], logprobs: list[dict[int, float]], text_offset: int
    ) -> p.CompletionLogProbs:
        out = p.CompletionLogProbs(text_offset=[], token_logprobs=[], tokens=[], top_logprobs=[])
        for tid, entry in zip(token_ids, logprobs):
            token = self.token_str(tid)
            out.text_offset.append(text_offset)
            text_offset += len(token)
            out.tokens.append(token)
            out.token_logprobs.append(entry.get(tid))
            out.top_logprobs.append({self.token_str(t): v for t, v in ranked_logprobs(entry)})
        return out

    def chat(self, token_ids: list[int], logprobs: list[dict[int, float]], top: int) -> p.ChatCompletionLogProbs:
        content = []
        for tid, entry in zip(token_ids, logprobs):
            token = self.token_str(tid)
            content.append(
                p.ChatCompletionLogProbsContent(
                    token=token,
                    logprob=entry.get(tid, float("-inf")),
                    bytes=list(token.encode("utf-8")),
                    top_logprobs=[
                        p.ChatCompletionLogProb(token=(s := self.token_str(t)), logprob=v, bytes=list(s.encode("utf-8")))
                        for t, v in ranked_logprobs(entry)[:top]
                    ],
                )
            )
        return p.ChatCompletionLogProbs(content=content)


def generate_logprobs(token_ids: list[int], logprobs: list[dict[int, float]]) -> p.GenerateLogProbs:
    content = [
        p.GenerateLogProbsContent(
            token_id=tid,
            logprob=entry.get(tid, float("-inf")),
            rank=_rank(entry, tid) if tid in entry else None,
            top_logprobs=[p.GenerateLogProb(token_id=t, logprob=v, rank=r + 1) for r, (t, v) in enumerate(ranked_logprobs(entry))],
        )
        for tid, entry in zip(token_ids, logprobs)
    ]
    return p.GenerateLogProbs(content=content)


def _logprobs(choice: CompletionOutput) -> list[dict[int, float]]:
    return choice.logprobs or []


async def completion_response(
    state: ServerState, req: p.CompletionRequest, request_id: str, finals: list[RequestOutput]
) -> p.CompletionResponse:
    fmt = LogprobFormatter(state.engine.tokenizer)
    with_ids = bool(req.return_token_ids)
    choices = []
    for i, out in enumerate(finals):
        for c in out.outputs:
            choices.append(
                p.CompletionResponseChoice(
                    index=i * req.n + c.index,
                    text=c.text,
                    logprobs=fmt.completion(c.token_ids, _logprobs(c), 0) if req.logprobs is not None else None,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    prompt_token_ids=list(out.prompt_token_ids) if with_ids else None,
                    token_ids=list(c.token_ids) if with_ids else None,
                    routed_experts=await state.encode_experts(c.routed_experts),
                    weight_version=state.weight_version(out),
                )
            )
    return p.CompletionResponse(id=request_id, model=state.model_name, choices=choices, usage=usage_of(state, finals))


async def chat_response(
    state: ServerState, req: p.ChatCompletionRequest, request_id: str, final: RequestOutput
) -> p.ChatCompletionResponse:
    fmt = LogprobFormatter(state.engine.tokenizer)
    with_ids = bool(req.return_token_ids)
    choices = [
        p.ChatCompletionResponseChoice(
            index=c.index,
            message=p.ChatMessage(role="assistant", content=c.text),
            logprobs=fmt.chat(c.token_ids, _logprobs(c), req.top_logprobs or 0) if req.logprobs else None,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
            token_ids=list(c.token_ids) if with_ids else None,
            routed_experts=await state.encode_experts(c.routed_experts),
            weight_version=state.weight_version(final),
        )
        for c in final.outputs
    ]
    return p.ChatCompletionResponse(
        id=request_id,
        model=state.model_name,
        choices=choices,
        usage=usage_of(state, [final]),
        prompt_token_ids=list(final.prompt_token_ids) if with_ids else None,
    )


async def generate_response(
    state: ServerState, req: p.GenerateRequest, request_id: str, final: RequestOutput
) -> p.GenerateResponse:
    text_mode = req.output_mode == "text"
    choices = [
        p.GenerateChoice(
            index=c.index,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
            token_ids=list(c.token_ids),
            logprobs=generate_logprobs(c.token_ids, c.logprobs) if c.logprobs is not None else None,
            routed_experts=await state.encode_experts(c.routed_experts),
            weight_version=state.weight_version(final),
            text=c.text if text_mode else UNSET,
        )
        for c in final.outputs
    ]
    return p.GenerateResponse(
        request_id=request_id,
        model=state.model_name,
        created=int(time.time()),
        output_mode=req.output_mode,
        choices=choices,
        usage=usage_of(state, [final]),
        prompt_token_ids=list(final.prompt_token_ids) if req.return_token_ids else None,
    )
