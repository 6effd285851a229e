"""The output processor: the engine core's token-level updates in, RequestOutputs out.

Per sequence it keeps the text (TextStream: the `tokenizers` library's DecodeStream), the
logprobs and what DELTA outputs have handed out; it finds stop strings, and builds the
CUMULATIVE / DELTA / FINAL_ONLY outputs. It never runs the model and holds no KV, so it
runs off the engine core's thread in AsyncLLM. A stop string found here is sent back to the
core (`StopSequence`): the core finishes the sequence and returns the rows of the kept
tokens; until then the request's outputs wait, so every output is a prefix of the final one.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import numpy as np

from r3srv.engine.input_processor import EngineRequest
from r3srv.engine.requests import CoreOutputs, RequestUpdate, SeqUpdate
from r3srv.engine.routed_experts import num_routed_rows
from r3srv.engine.text_stream import TextStream
from r3srv.outputs import CompletionOutput, Logprob, OutputKind, RequestOutput, SamplingMasks, WeightVersionSpan


@dataclass(frozen=True, slots=True)
class StopSequence:
    """For the core: a stop string ended sequence `index`, after `num_output_tokens` tokens."""

    request_id: str
    index: int
    num_output_tokens: int
    stop: str


@dataclass
class ProcessedOutputs:
    outputs: list[RequestOutput] = field(default_factory=list)
    stops: list[StopSequence] = field(default_factory=list)  # to send to the core
    failed: list[tuple[str, BaseException]] = field(default_factory=list)  # (request_id, error)
    # requests that failed here (a detokenizer error), which the core still runs: abort them there
    to_abort: list[str] = field(default_factory=list)


class SeqState:
    """One sample's output side: its output tokens, text, logprobs, and how it ended."""

    __slots__ = ("index", "params", "num_prompt_tokens", "token_ids", "logprobs", "cumulative_logprobs", "stream",
                 "finish_reason", "stop_reason", "routed_experts", "routed_expert_weights", "indexer_topk", "num_preempted", "num_emitted_tokens", "num_emitted_chars",
                 "stopping", "masks", "version_starts")

    def __init__(self, index: int, prep: EngineRequest, tokenizer) -> None:
        p = prep.params
        self.index = index
        self.params = p
        self.num_prompt_tokens = len(prep.prompt_token_ids)
        self.token_ids: list[int] = []  # output tokens
        self.logprobs: list[dict[int, Logprob]] | None = [] if p.logprobs is not None else None
        # Running sums of the output tokens' logprobs: [i] covers tokens 0..i, so a stop-string
        # cut or a held-back partial output reads its sum in O(1).
        self.cumulative_logprobs: list[float] = []
        # detokenize=False: token ids only, no text (vLLM's)
        self.stream = TextStream(tokenizer if p.detokenize else None, prep.prompt_token_ids, p.skip_special_tokens,
                                 p.spaces_between_special_tokens)
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.routed_experts: np.ndarray | None = None
        self.routed_expert_weights: np.ndarray | None = None
        self.indexer_topk: np.ndarray | None = None
        self.num_preempted = 0
        # What DELTA outputs have handed out so far (output tokens, text characters).
        self.num_emitted_tokens = 0
        self.num_emitted_chars = 0
        self.stopping = False  # a stop string ended it here; the core has not confirmed yet
        # return_sampling_mask: each output token's (ids, logprobs), cut with the tokens
        self.masks: list[tuple[np.ndarray, np.ndarray]] | None = [] if p.return_sampling_mask else None
        # (weight version, first output token it drew) at each change of the drawing weights
        self.version_starts: list[tuple[str, int]] = []

    @property
    def text(self) -> str:
        return self.stream.text

    @property
    def cumulative_logprob(self) -> float:
        return self.cumulative_logprobs[-1] if self.cumulative_logprobs else 0.0

    def append(self, sample, silent: bool = False) -> str:
        version = sample.weight_version
        if version is not None and (not self.version_starts or self.version_starts[-1][0] != version):
            self.version_starts.append((version, len(self.token_ids)))
        self.token_ids.append(sample.token_id)
        if self.logprobs is not None:
            self.logprobs.append(sample.top_logprobs)
            self.cumulative_logprobs.append(self.cumulative_logprob + sample.logprob)
        if self.masks is not None:
            self.masks.append((sample.mask_ids, sample.mask_logprobs))
        return self.stream.add(sample.token_id, silent)

    def cut(self, kept_len: int, kept_tokens: int) -> None:
        self.stream.truncate(kept_len, kept_tokens)
        del self.token_ids[kept_tokens:]
        if self.logprobs is not None:
            del self.logprobs[kept_tokens:]
            del self.cumulative_logprobs[kept_tokens:]
        if self.masks is not None:
            del self.masks[kept_tokens:]
        while self.version_starts and self.version_starts[-1][1] >= kept_tokens:
            self.version_starts.pop()

    def weight_versions(self) -> list[WeightVersionSpan]:
        """The spans of weights that drew the output tokens, in order, covering all of them."""
        starts = self.version_starts
        ends = [start for _, start in starts[1:]] + [len(self.token_ids)]
        return [WeightVersionSpan(version, start, end) for (version, start), end in zip(starts, ends)]

    def take_rows(self, rows: np.ndarray | None, weights: np.ndarray | None = None) -> None:
        """The core's rows (and their weights), less those of tokens a stop string cut after the
        core's last step."""
        n = num_routed_rows(self.num_prompt_tokens + len(self.token_ids), self.params.routed_experts_prompt_start)
        self.routed_experts = rows if rows is None or len(rows) == n else rows[:n]
        self.routed_expert_weights = weights if weights is None or len(weights) == n else weights[:n]

    def take_indexer_topk(self, selections: np.ndarray | None) -> None:
        """The core's indexer selections, less those of tokens a stop string cut."""
        n = num_routed_rows(self.num_prompt_tokens + len(self.token_ids), self.params.indexer_topk_prompt_start)
        self.indexer_topk = selections if selections is None or len(selections) == n else selections[:n]


class RequestState:
    __slots__ = ("prep", "seqs", "num_cached_tokens", "weight_version", "arrival_time", "first_token_time",
                 "prompt_logprobs", "lora")

    def __init__(self, prep: EngineRequest, tokenizer) -> None:
        self.prep = prep
        self.seqs = [SeqState(i, prep, tokenizer) for i in range(prep.params.n)]
        self.num_cached_tokens = 0
        self.weight_version: str | None = None
        self.arrival_time: float | None = None
        self.first_token_time: float | None = None
        self.prompt_logprobs: list | None = None  # the core sends them once, all computed
        self.lora: tuple[str, int] | None = None


class OutputProcessor:
    """Not thread-safe: one thread (or one event loop) calls it."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}

    def add_request(self, prep: EngineRequest) -> None:
        self.requests[prep.request_id] = RequestState(prep, self.tokenizer)

    def abort(self, request_id: str) -> RequestOutput | None:
        """The final output of a request the core never saw or no longer holds (finish_reason
        "abort" for every unfinished sample); None if unknown."""
        st = self.requests.pop(request_id, None)
        if st is None:
            return None
        for s in st.seqs:
            if s.finish_reason is None or s.stopping:
                s.finish_reason, s.stopping = "abort", False
        return _request_output(st, True)

    def process(self, core_outputs: CoreOutputs) -> ProcessedOutputs:
        res = ProcessedOutputs()
        for rid, exc in core_outputs.failed:
            if self.requests.pop(rid, None) is not None:
                res.failed.append((rid, exc))
        for update in core_outputs.updates:
            st = self.requests.get(update.request_id)
            if st is None:  # failed or aborted here meanwhile
                continue
            try:
                self._apply(st, update, res.stops)
            except Exception as exc:  # e.g. a detokenizer error: fail this request only
                del self.requests[update.request_id]
                res.failed.append((update.request_id, exc))
                res.to_abort.append(update.request_id)
                continue
            finished = True
            for s in st.seqs:
                if s.stopping:
                    break  # the core's answer to the stop brings the next output
                if s.finish_reason is None:
                    finished = False
            else:
                self._emit(st, finished, res.outputs)
        return res

    def _emit(self, st: RequestState, finished: bool, outputs: list[RequestOutput]) -> None:
        if finished or st.prep.output_kind is not OutputKind.FINAL_ONLY:
            outputs.append(_request_output(st, finished))
        if finished:
            del self.requests[st.prep.request_id]

    def _apply(self, st: RequestState, update: RequestUpdate, stops: list[StopSequence]) -> None:
        st.num_cached_tokens = update.num_cached_tokens
        st.weight_version = update.weight_version
        st.lora = update.lora
        st.arrival_time = update.arrival_time
        st.first_token_time = update.first_token_time
        if update.prompt_logprobs is not None:
            st.prompt_logprobs = update.prompt_logprobs
        for su in update.seqs:
            s = st.seqs[su.index]
            if su.sample is not None and s.finish_reason is None:  # tokens after a stop string are dropped
                # As vLLM: the text of a stop token or EOS (the core finished the sequence on the
                # token itself) is left out unless include_stop_str_in_output.
                silent = su.finish_reason == "stop" and not s.params.include_stop_str_in_output
                delta = s.append(su.sample, silent)
                if su.finish_reason != "stop" and self._stop_string(s, delta):  # a stop token comes first
                    if su.finish_reason is None:  # the core still runs it
                        s.stopping = True
                        stops.append(StopSequence(update.request_id, s.index, len(s.token_ids), s.stop_reason))
                        continue
            self._finish(s, su)

    @staticmethod
    def _stop_string(s: SeqState, delta: str) -> bool:
        p = s.params
        if not p.stop or len(s.token_ids) < p.min_tokens:
            return False
        hit = s.stream.find_stop(p.stop, len(delta), p.include_stop_str_in_output)
        if hit is None:
            return False
        stop, kept_len, kept_tokens = hit
        s.cut(kept_len, kept_tokens)
        s.finish_reason, s.stop_reason = "stop", stop
        return True

    @staticmethod
    def _finish(s: SeqState, su: SeqUpdate) -> None:
        if su.finish_reason is None:
            return
        if s.finish_reason is None or (s.stopping and su.finish_reason in ("abort", "error")):
            s.finish_reason, s.stop_reason = su.finish_reason, su.stop_reason
        s.stopping = False
        s.num_preempted = su.num_preempted
        s.take_rows(su.routed_experts, su.routed_expert_weights)
        s.take_indexer_topk(su.indexer_topk)


def _request_output(st: RequestState, finished: bool) -> RequestOutput:
    prep = st.prep
    delta = prep.output_kind is OutputKind.DELTA
    metrics = {"arrival_time": st.arrival_time} if st.arrival_time is not None else {}
    if st.first_token_time is not None and st.arrival_time is not None:
        metrics["first_token_latency_s"] = st.first_token_time - st.arrival_time
    return RequestOutput(
        request_id=prep.request_id,
        prompt=prep.prompt,
        prompt_token_ids=prep.prompt_token_ids,
        outputs=[completion_output(s, delta) for s in st.seqs],
        finished=finished,
        num_cached_tokens=st.num_cached_tokens,
        prompt_logprobs=st.prompt_logprobs,
        weight_version=st.weight_version,
        lora_name=None if st.lora is None else st.lora[0],
        lora_version=None if st.lora is None else st.lora[1],
        metrics=metrics,
        image_grid_thw=None if prep.multimodal is None else prep.multimodal.grids,
        image_placeholders=None if prep.multimodal is None else prep.multimodal.placeholders,
    )


def completion_output(s: SeqState, delta: bool) -> CompletionOutput:
    """A sequence's output so far, or (delta) what is new since its previous output.

    While it runs, text (and the tokens producing it) that a stop string could still cut
    is held back, so every partial output is a prefix of the final one."""
    n, text_len = _visible(s)
    cumulative = None
    if s.logprobs is not None:
        cumulative = s.cumulative_logprobs[n - 1] if n else 0.0
    first_token, first_char = (s.num_emitted_tokens, s.num_emitted_chars) if delta else (0, 0)
    if delta:
        s.num_emitted_tokens, s.num_emitted_chars = n, text_len
    return CompletionOutput(
        index=s.index,
        text=s.text[first_char:text_len],
        token_ids=s.token_ids[first_token:n],
        finish_reason=s.finish_reason,
        stop_reason=s.stop_reason,
        cumulative_logprob=cumulative,
        logprobs=s.logprobs[first_token:n] if s.logprobs is not None else None,
        routed_experts=s.routed_experts,
        routed_expert_weights=s.routed_expert_weights,
        indexer_topk=s.indexer_topk,
        sampling_mask=SamplingMasks.of(s.masks[first_token:n]) if s.masks is not None else None,
        num_preempted=s.num_preempted,
        weight_versions=s.weight_versions() if s.finish_reason is not None else None,
    )


def _visible(s: SeqState) -> tuple[int, int]:
    """(output tokens, text characters) that no stop string can still cut from `s`."""
    p = s.params
    text = s.text
    if s.finish_reason is not None or not p.stop or p.include_stop_str_in_output:
        return len(s.token_ids), len(text)
    # A stop string not seen yet ends in text still to come, so it starts at or after `safe`:
    # the final text keeps at least `safe` characters, and at least the tokens up to the
    # first one whose text reaches `safe` (tokens that add no text, such as the leading bytes
    # of a multi-byte character, stay held back until text follows them).
    safe = max(0, len(text) - (max(len(x) for x in p.stop) - 1))
    ends = s.stream.text_len_after
    n = min(bisect.bisect_left(ends, safe) + 1, bisect.bisect_right(ends, safe)) if safe else 0
    return n, ends[n - 1] if n else 0
