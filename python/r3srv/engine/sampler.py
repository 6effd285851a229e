"""Next-token sampling in vLLM's order: the min_tokens mask, logit_bias, then repetition,
frequency and presence penalties (all of which can change a greedy pick); then greedy (ties to
the lowest id) or temperature, min_p, top-k, top-p and a draw (per-sequence torch.Generator for
seeded requests); and logprobs, sampled and prompt. Rows that ask for their sampling mask get
the support of the distribution actually drawn from, read from it after every filter.

Logprobs follow vLLM's `logprobs_mode`: by default (raw_logprobs) the log-softmax of the model's
unmodified logits (before every adjustment above); raw_logits those logits themselves;
processed_logprobs and processed_logits the log-softmax of, or the logits the draw read (after
the bans, bias, penalties, temperature, min_p, top-k and top-p; a greedy row's after the
adjustments only, as vLLM's), a filtered-out token's at -inf. Prompt logprobs are never
processed: the logits or their log-softmax. Rows without bias, penalties or a min_tokens mask
skip those steps entirely: a batch of plain requests costs what it did before they existed.

Every value a request may send is safe to draw with: vLLM accepts any repetition penalty above 0,
and one of 1e-108 (0 in float32) or 1e300 (inf) would make the adjusted logits inf or NaN, which
softmax and the draw cannot take. The penalty is held within float32's positive range, and the
adjusted logits (and their temperature-scaled copy) are made finite: +inf saturates at float32's
largest value (the overflowing tokens then tie, as their order is lost), NaN becomes -inf (never
drawn), -inf stays a mask.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from r3srv.engine.sequence import Sequence
from r3srv.outputs import Logprob
from r3srv.sampling_params import SamplingParams
from r3srv.transfer import to_device

_FLOAT32 = torch.finfo(torch.float32)
_LOGITS_MODES = ("raw_logits", "processed_logits")  # the others' values are log-softmaxes


@dataclass
class SampleResult:
    token_id: int
    logprob: float | None = None  # of the sampled token; None unless logprobs were asked for
    # the sampled token first (its vocabulary rank), then the top `logprobs` tokens (ranks 1, 2, ...)
    top_logprobs: dict[int, Logprob] | None = None
    # return_sampling_mask: the ids the draw could pick (int32, ascending) and their logprobs
    # under the distribution it drew from (float32); a greedy pick's is the pick alone, at 0.0
    mask_ids: np.ndarray | None = None
    mask_logprobs: np.ndarray | None = None
    # the weights that drew it (the engine's weight_version when its step was queued), set by
    # the step's bookkeeping
    weight_version: str | None = None


def finite_(logits: torch.Tensor) -> torch.Tensor:
    """`logits` in place with +inf at float32's largest value and NaN at -inf; -inf (a mask) kept."""
    return torch.nan_to_num_(logits, nan=float("-inf"), posinf=_FLOAT32.max, neginf=float("-inf"))


@dataclass(slots=True)
class SampleView:
    """What sampling reads of a sequence, taken when its step is queued, so that a step sampled
    on another thread (overlapped steps) never reads a sequence the host is changing: its
    params and generator, its output count, its output ids (penalized rows only), its prompt's
    ids until the mask a repetition penalty over the prompt reads is known (sampling sets it
    here; the core keeps it on the sequence)."""

    params: SamplingParams
    generator: torch.Generator | None
    num_output_tokens: int
    adjusts_logits: bool
    num_prompt_tokens: int
    output_token_ids: list[int] | None = None
    token_ids: list[int] | None = None  # the prompt's, while prompt_token_mask is unknown
    prompt_token_mask: torch.Tensor | None = None
    # the last output id is the previous overlapped step's sample in this row, not read back yet
    pending: int | None = None

    @classmethod
    def of(cls, seq: Sequence, pending: int | None = None) -> "SampleView":
        p = seq.params
        prompt = p.penalized and p.repetition_penalty_prompt and seq.prompt_token_mask is None  # as _adjust reads
        return cls(p, seq.generator, seq.num_output_tokens, seq.adjusts_logits, seq.num_prompt_tokens,
                   seq.output_token_ids if p.penalized else None,
                   seq.token_ids[: seq.num_prompt_tokens] if prompt else None, seq.prompt_token_mask,
                   pending if p.penalized else None)

    def fill_pending(self, last: list[int] | None) -> None:
        """The pending output id, from the previous step's samples (None: that step failed, and
        this row's request with it: any id does)."""
        if self.pending is not None:
            self.output_token_ids[-1] = 0 if last is None else last[self.pending]


Sampled = SampleView | Sequence  # what sampling reads a row's sequence through


def _banned_ids(seq: Sampled, eos_token_ids: list[int]) -> list[int]:
    """Tokens banned until min_tokens outputs exist: stop_token_ids and EOS (with ignore_eos too,
    as vLLM, whose min_tokens processor bans all_stop_token_ids, EOS always among them)."""
    p = seq.params
    if seq.num_output_tokens >= p.min_tokens:
        return []
    return list(p.stop_token_ids or []) + eos_token_ids


def _adjusted(seq: Sampled) -> bool:
    """Whether the row's logits change before a greedy pick (bias, penalties, min_tokens mask)."""
    return seq.adjusts_logits or seq.num_output_tokens < seq.params.min_tokens


def apply_penalties(
    logits: torch.Tensor,
    prompt_seen: torch.Tensor | None,
    output_ids: list[list[int]],
    presence: list[float],
    frequency: list[float],
    repetition: list[float],
) -> torch.Tensor:
    """vLLM's penalties on `logits` [rows, vocab] (in place): a repetition penalty divides the
    positive logits and multiplies the negative ones of every token in the row's prompt
    (`prompt_seen`, [rows, vocab] bool; None or a False row: output tokens only, as SGLang's) or
    output; then the frequency penalty times each token's count in the output, and the presence
    penalty once per token in it, are subtracted (OpenAI's definition)."""
    device = logits.device
    counts = token_counts(output_ids, logits.shape[1], device)
    in_output = counts > 0
    if any(r != 1.0 for r in repetition):
        seen = in_output if prompt_seen is None else in_output | prompt_seen
        held = [min(max(r, _FLOAT32.tiny), _FLOAT32.max) for r in repetition]  # never 0 or inf in float32
        (rep,) = to_device([held], device, np.float32)
        factor = torch.where(seen, rep[:, None], 1.0)
        logits *= torch.where(logits > 0, 1.0 / factor, factor)
    freq, pres = to_device([frequency, presence], device, np.float32)
    logits -= freq[:, None] * counts + pres[:, None] * in_output
    return finite_(logits)


def token_counts(ids: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[rows, vocab] float32: how often each token occurs in each row's ids (one transfer, one
    scatter for the whole batch)."""
    lengths = [len(x) for x in ids]
    counts = torch.zeros(len(ids), vocab, dtype=torch.float32, device=device)
    if sum(lengths):
        flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int64, count=sum(lengths))
        rows = np.repeat(np.arange(len(ids)), lengths)
        (where,) = to_device([np.stack([rows, flat])], device)
        counts.index_put_((where[0], where[1]), torch.ones((), device=device), accumulate=True)
    return counts


def _prompt_seen(seq: Sampled, vocab: int, device: torch.device) -> torch.Tensor:
    """[vocab] bool: the tokens of the sequence's prompt (computed once, kept on the sequence)."""
    mask = seq.prompt_token_mask
    if mask is None or mask.device != device or mask.shape[0] != vocab:
        mask = token_counts([seq.token_ids[: seq.num_prompt_tokens]], vocab, device)[0] > 0
        seq.prompt_token_mask = mask
    return mask


def apply_min_p(logits: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """Mask (to -inf) the tokens whose probability is below min_p times the row's highest
    (`logits` already temperature-scaled), as vLLM's MinPLogitsProcessor."""
    probs = torch.softmax(logits, dim=-1)
    (mp,) = to_device([min_p], logits.device, np.float32)
    threshold = probs.amax(dim=-1, keepdim=True) * mp[:, None]
    return logits.masked_fill(probs < threshold, float("-inf"))


def _adjust(logits: torch.Tensor, seqs: list[Sampled], eos_token_ids: list[int]) -> torch.Tensor:
    """A copy of `logits` with the min_tokens mask, logit_bias and penalties applied to the rows
    that ask for them (batched over those rows; `logits` itself, which logprobs read, is kept)."""
    rows, vocab = logits.shape
    device = logits.device
    banned = [(r, b) for r, s in enumerate(seqs) for b in _banned_ids(s, eos_token_ids) if 0 <= b < vocab]
    if banned:
        where = torch.tensor(banned, dtype=torch.int64, device=device)
        logits = logits.index_put((where[:, 0], where[:, 1]), torch.tensor(float("-inf"), device=device))
    biased = [(r, t, b) for r, s in enumerate(seqs) if s.params.logit_bias for t, b in s.params.logit_bias.items()
              if 0 <= t < vocab]
    if biased:
        (where,) = to_device([[(r, t) for r, t, _ in biased]], device)
        (values,) = to_device([[b for _, _, b in biased]], device, np.float32)
        logits = logits.index_put((where[:, 0], where[:, 1]), values, accumulate=True)
    penalized = [r for r, s in enumerate(seqs) if s.params.penalized]
    if penalized:
        ps = [seqs[r] for r in penalized]
        prompt_seen = None
        if any(s.params.repetition_penalty != 1.0 and s.params.repetition_penalty_prompt for s in ps):
            none = torch.zeros(vocab, dtype=torch.bool, device=device)
            prompt_seen = torch.stack([
                _prompt_seen(s, vocab, device) if s.params.repetition_penalty_prompt else none for s in ps])
        sub = apply_penalties(
            logits[penalized],
            prompt_seen,
            [s.output_token_ids for s in ps],
            [s.params.presence_penalty for s in ps],
            [s.params.frequency_penalty for s in ps],
            [s.params.repetition_penalty for s in ps],
        )
        (index,) = to_device([penalized], device)
        logits = logits.index_put((index,), sub)
    return logits


def filter_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Mask (to -inf) what each row's top-k and top-p exclude; `logits` [rows, vocab], already
    temperature-scaled. top_k <= 0 or >= vocab and top_p >= 1 leave a row alone.

    Batched over the rows (one sort, not one per row): top-k keeps every logit >= the k-th
    largest (ties at the k-th all stay); top-p then drops a token when the probability mass
    before it, in descending order (stable: ties by id), already reaches top_p."""
    rows, vocab = logits.shape
    device = logits.device
    k = [kk if 0 < kk < vocab else vocab for kk in top_k]
    if min(k) < vocab:
        top = torch.topk(logits, max(k), dim=-1).values
        kth = top.gather(1, torch.tensor(k, device=device)[:, None] - 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if min(top_p) < 1.0:
        # p >= 1: never drop (the float sum may reach 1.0 before the last token)
        p = torch.tensor([pp if pp < 1.0 else float("inf") for pp in top_p], device=device)
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = (torch.cumsum(probs, dim=-1) - probs) >= p[:, None]
        logits = logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits


def sample(
    logits: torch.Tensor, seqs: list[Sampled], eos_token_ids: list[int], generator: torch.Generator | None = None,
    logprobs_mode: str = "raw_logprobs",
) -> list[SampleResult]:
    """One token for each row of `logits` ([B, vocab], float32) and its sequence; logprobs, for
    the rows that ask, as `logprobs_mode` says (module docstring).

    Masks, temperatures, top-k / top-p and softmax are batched over the rows; requests without
    a seed draw together from `generator` (the engine's; None: torch's default), in one
    multinomial. Only a seeded request's draw (from its own generator) runs per row.

    Picks and logprobs are read back with a few `.tolist()` calls per step, not one or
    more per sequence: on CUDA each read-back is a device sync.
    """
    logits = logits.float()
    token_ids = [0] * len(seqs)
    plain_greedy = [i for i, s in enumerate(seqs) if s.params.greedy and not _adjusted(s)]
    if plain_greedy:
        # torch.argmax returns the first maximal index: ties go to the lowest id.
        greedy_rows = logits if len(plain_greedy) == len(seqs) else logits[plain_greedy]  # all: no copy, no index
        for i, tok in zip(plain_greedy, torch.argmax(greedy_rows, dim=-1).tolist()):
            token_ids[i] = tok
    plain = set(plain_greedy)
    others = [i for i in range(len(seqs)) if i not in plain]
    supports: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    want = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    keep = bool(want) and logprobs_mode.startswith("processed")
    drawn = None  # with keep: the rows of `others` as their picks read them
    if len(others) == len(seqs):  # no plain greedy row: no gathered copy
        token_ids, supports, drawn = _pick(logits, seqs, eos_token_ids, generator, keep)
    elif others:
        picks, found, drawn = _pick(logits[others], [seqs[i] for i in others], eos_token_ids, generator, keep)
        for i, tok in zip(others, picks):
            token_ids[i] = tok
        supports = {others[j]: v for j, v in found.items()}
    results = [SampleResult(tok) for tok in token_ids]
    for i, s in enumerate(seqs):
        if s.params.greedy and s.params.return_sampling_mask:
            _set_greedy_mask(results[i])
    for i, (ids, logps) in supports.items():
        results[i].mask_ids, results[i].mask_logprobs = ids, logps
    # The sampled token first, with its rank in the vocabulary, then the top `logprobs` tokens
    # with ranks 1, 2, ..., as vLLM's
    if want:
        entries = logprob_entries(_scores(logits, drawn, others, want, logprobs_mode), [token_ids[i] for i in want],
                                  [seqs[i].params.logprobs for i in want])
        for i, entry in zip(want, entries):
            res = results[i]
            res.logprob = entry[res.token_id].logprob
            res.top_logprobs = entry
    return results


def _scores(logits: torch.Tensor, drawn: torch.Tensor | None, others: list[int], want: list[int],
            logprobs_mode: str) -> torch.Tensor:
    """The `want` rows' values logprobs report: of the raw `logits`, or (processed modes) of what
    the picks read: `drawn` for the `others` rows, the raw logits for plain greedy rows."""
    rows = (logits if drawn is None else _replaced(logits, others, drawn))[want]
    return rows if logprobs_mode in _LOGITS_MODES else torch.log_softmax(rows, dim=-1)


def _replaced(base: torch.Tensor, index: list[int], rows: torch.Tensor) -> torch.Tensor:
    """`base` with its rows `index` replaced by `rows`: `rows` itself when they are all of them,
    else a copy (`base` may be the caller's logits)."""
    if len(index) == base.shape[0]:
        return rows
    out = base.clone()
    out[index] = rows
    return out


def _set_greedy_mask(res: SampleResult) -> None:
    """A greedy pick's sampling mask: the pick alone, certain (as SGLang's)."""
    res.mask_ids = np.array([res.token_id], dtype=np.int32)
    res.mask_logprobs = np.zeros(1, dtype=np.float32)


def sampling_supports(probs: torch.Tensor) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each row's support of `probs` ([rows, vocab], the distribution a draw reads): the ids of
    the tokens it can draw (probability > 0), ascending, int32, and their log-probabilities,
    float32. One device-to-host copy of the kept entries for all rows."""
    kept = probs > 0
    counts = kept.sum(dim=-1).tolist()
    where = kept.nonzero()
    ids = where[:, 1].to(torch.int32).cpu().numpy()
    logps = torch.log(probs[where[:, 0], where[:, 1]]).cpu().numpy()
    cuts = np.cumsum([0, *counts])
    return [(ids[a:b], logps[a:b]) for a, b in zip(cuts[:-1], cuts[1:])]


def _pick(logits: torch.Tensor, seqs: list[Sampled], eos_token_ids: list[int], generator,
          keep: bool = False) -> tuple[list[int], dict[int, tuple[np.ndarray, np.ndarray]], torch.Tensor | None]:
    """Tokens for rows that are not plain greedy: greedy after bias/penalties/min_tokens, or
    sampled; the sampling masks (by row) of the sampled rows that ask for them; with `keep`, the
    logits each pick read ([rows, vocab]: a greedy row's adjusted, a sampled row's filtered and
    temperature-scaled), else None.

    Every full-size pass over [rows, vocab] counts at large vocabularies, so rows are only
    gathered (copied) when the batch mixes kinds."""
    rows, vocab = logits.shape
    device = logits.device
    adjusted = any(_adjusted(s) for s in seqs)
    if adjusted:
        logits = _adjust(logits, seqs, eos_token_ids)
    greedy = [r for r, s in enumerate(seqs) if s.params.greedy]
    sampled = [r for r, s in enumerate(seqs) if not s.params.greedy]
    picks = [0] * rows
    if greedy:
        for r, tok in zip(greedy, torch.argmax(logits[greedy], dim=-1).tolist()):
            picks[r] = tok
    if not sampled:
        return picks, {}, logits if keep else None
    x = logits if len(sampled) == rows else logits[sampled]
    (temperatures,) = to_device([[seqs[r].params.temperature for r in sampled]], device, np.float32)
    x = x / temperatures[:, None]
    if adjusted:  # a saturated logit over a small temperature overflows again
        finite_(x)
    with_min_p = [j for j, r in enumerate(sampled) if seqs[r].params.min_p > 0.0]
    if with_min_p:
        x[with_min_p] = apply_min_p(x[with_min_p], [seqs[sampled[j]].params.min_p for j in with_min_p])
    filtered = [j for j, r in enumerate(sampled) if 0 < seqs[r].params.top_k < vocab or seqs[r].params.top_p < 1.0]
    if filtered:
        params = [seqs[sampled[j]].params for j in filtered]
        x[filtered] = filter_top_k_top_p(x[filtered], [p.top_k for p in params], [p.top_p for p in params])
    probs = torch.softmax(x, dim=-1)
    own = [j for j, r in enumerate(sampled) if seqs[r].generator is not None]
    if not own:  # requests without a seed: one batched draw
        draws = torch.multinomial(probs, 1, generator=generator)[:, 0]
    else:
        draws = torch.empty(len(sampled), dtype=torch.int64, device=device)
        shared = [j for j, r in enumerate(sampled) if seqs[r].generator is None]
        if shared:
            draws[shared] = torch.multinomial(probs[shared], 1, generator=generator)[:, 0]
        # a seeded request draws from its own generator, so its samples depend on its seed alone
        draws[own] = torch.cat([torch.multinomial(probs[j], 1, generator=seqs[sampled[j]].generator) for j in own])
    for r, tok in zip(sampled, draws.tolist()):
        picks[r] = tok
    drawn = _replaced(logits, sampled, x) if keep else None
    masked = [j for j, r in enumerate(sampled) if seqs[r].params.return_sampling_mask]
    if not masked:
        return picks, {}, drawn
    found = sampling_supports(probs if len(masked) == len(sampled) else probs[masked])
    return picks, {sampled[j]: support for j, support in zip(masked, found)}, drawn


def prompt_logprobs(logits: torch.Tensor, targets: list[int], num_top: list[int],
                    logprobs_mode: str = "raw_logprobs") -> list[dict[int, Logprob]]:
    """One entry per row of `logits` ([R, vocab], the rows of prompt positions) for the next
    prompt token (`targets[i]`), as vLLM's prompt logprobs (logprob_entries): the logits
    themselves in the logits modes, else their log-softmax (prompt tokens skip the sampler's
    processing, so processed_* reads as raw_*, as in vLLM)."""
    scores = logits.float()
    return logprob_entries(scores if logprobs_mode in _LOGITS_MODES else torch.log_softmax(scores, dim=-1),
                           targets, num_top)


def logprob_entries(logps: torch.Tensor, targets: list[int], num_top: list[int]) -> list[dict[int, Logprob]]:
    """One entry per row of `logps` ([R, vocab] log-probabilities, or logits in the logits
    modes: ranks and order are the same): the row's token
    (`targets[i]`, sampled or the next prompt token) first, with its logprob and vocabulary
    rank (1 + the tokens strictly more likely), then the row's top `num_top[i]` tokens (-1:
    all) with ranks 1, 2, ..., as vLLM's Logprob entries. Batched over the rows."""
    rows, vocab = logps.shape
    (target,) = to_device([targets], logps.device)
    chosen = logps.gather(1, target[:, None])
    ranks = (logps > chosen).sum(dim=-1).add_(1).tolist()
    chosen_values = chosen[:, 0].tolist()
    k = [vocab if n == -1 else min(n, vocab) for n in num_top]
    top_ids: list[list[int]] = [[] for _ in range(rows)]
    top_values: list[list[float]] = [[] for _ in range(rows)]
    if max(k):
        top = torch.topk(logps, max(k), dim=-1)  # sorted; ties to the lower id as torch.topk gives them
        top_ids, top_values = top.indices.tolist(), top.values.tolist()
    entries = []
    for i in range(rows):
        entry = {targets[i]: Logprob(chosen_values[i], ranks[i])}
        for rank, (tok, value) in enumerate(zip(top_ids[i][: k[i]], top_values[i][: k[i]]), start=1):
            entry.setdefault(tok, Logprob(value, rank))
        entries.append(entry)
    return entries
