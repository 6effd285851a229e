"""Next-token sampling: greedy (ties to the lowest id), temperature, top-k, top-p,
per-sequence torch.Generator for seeded requests, min_tokens, and logprobs.

Logprobs are the log-softmax of the model's unmodified logits (before temperature,
top-k/top-p and the min_tokens mask), as vLLM reports them by default.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from r3srv.engine.sequence import Sequence
from r3srv.transfer import to_device


@dataclass
class SampleResult:
    token_id: int
    logprob: float | None = None  # of the sampled token; None unless logprobs were asked for
    top_logprobs: dict[int, float] | None = None  # sampled token + the top `logprobs` tokens


def _banned_ids(seq: Sequence, eos_token_ids: list[int]) -> list[int]:
    """Tokens that would end the sequence before min_tokens outputs exist."""
    p = seq.params
    if seq.num_output_tokens >= p.min_tokens:
        return []
    banned = list(p.stop_token_ids or [])
    if not p.ignore_eos:
        banned += eos_token_ids
    return banned


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
    logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: list[int], generator: torch.Generator | None = None
) -> list[SampleResult]:
    """One token for each row of `logits` ([B, vocab], float32) and its sequence.

    Masks, temperatures, top-k / top-p and softmax are batched over the rows; requests without
    a seed draw together from `generator` (the engine's; None: torch's default), in one
    multinomial. Only a seeded request's draw (from its own generator) runs per row.

    Picks and logprobs are read back with a few `.tolist()` calls per step, not one or
    more per sequence: on CUDA each read-back is a device sync.
    """
    logits = logits.float()
    token_ids = [0] * len(seqs)
    plain_greedy = [
        i for i, s in enumerate(seqs) if s.params.greedy and not _banned_ids(s, eos_token_ids)
    ]
    if plain_greedy:
        # torch.argmax returns the first maximal index: ties go to the lowest id.
        greedy_rows = logits if len(plain_greedy) == len(seqs) else logits[plain_greedy]  # all: no copy, no index
        for i, tok in zip(plain_greedy, torch.argmax(greedy_rows, dim=-1).tolist()):
            token_ids[i] = tok
    plain = set(plain_greedy)
    others = [i for i in range(len(seqs)) if i not in plain]
    if len(others) == len(seqs):  # no plain greedy row: no gathered copy
        token_ids = _pick(logits, seqs, eos_token_ids, generator)
    elif others:
        for i, tok in zip(others, _pick(logits[others], [seqs[i] for i in others], eos_token_ids, generator)):
            token_ids[i] = tok
    results = [SampleResult(tok) for tok in token_ids]
    # Logprobs from the unmodified logits.
    want = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    if want:
        logps = torch.log_softmax(logits[want], dim=-1)
        picked = torch.tensor([token_ids[i] for i in want], dtype=torch.int64, device=logps.device)
        sampled = logps.gather(1, picked[:, None])[:, 0].tolist()
        n_top = max(seqs[i].params.logprobs for i in want)
        if n_top:
            top = torch.topk(logps, min(n_top, logps.shape[-1]), dim=-1)
            top_vals, top_ids = top.values.tolist(), top.indices.tolist()
        for row_idx, i in enumerate(want):
            res = results[i]
            k = seqs[i].params.logprobs
            top_lp = dict(zip(top_ids[row_idx][:k], top_vals[row_idx][:k])) if k else {}
            res.logprob = sampled[row_idx]
            top_lp[res.token_id] = res.logprob  # the sampled token, listed last unless among the top
            res.top_logprobs = top_lp
    return results


def _pick(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: list[int], generator) -> list[int]:
    """Tokens for rows that are not plain greedy: greedy under a min_tokens mask, or sampled.

    Every full-size pass over [rows, vocab] counts at large vocabularies, so rows are only
    gathered (copied) when the batch mixes kinds."""
    rows, vocab = logits.shape
    device = logits.device
    banned = [(r, b) for r, s in enumerate(seqs) for b in _banned_ids(s, eos_token_ids) if 0 <= b < vocab]
    if banned:
        where = torch.tensor(banned, dtype=torch.int64, device=device)
        logits = logits.index_put((where[:, 0], where[:, 1]), torch.tensor(float("-inf"), device=device))
    greedy = [r for r, s in enumerate(seqs) if s.params.greedy]
    sampled = [r for r, s in enumerate(seqs) if not s.params.greedy]
    picks = [0] * rows
    if greedy:
        for r, tok in zip(greedy, torch.argmax(logits[greedy], dim=-1).tolist()):
            picks[r] = tok
    if not sampled:
        return picks
    x = logits if len(sampled) == rows else logits[sampled]
    (temperatures,) = to_device([[seqs[r].params.temperature for r in sampled]], device, np.float32)
    x = x / temperatures[:, None]
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
    return picks
