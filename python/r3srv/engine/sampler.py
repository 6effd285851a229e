"""Next-token sampling: greedy (ties to the lowest id), temperature, top-k, top-p,
per-sequence torch.Generator for seeded requests, min_tokens, and logprobs.

Logprobs are the log-softmax of the model's unmodified logits (before temperature,
top-k/top-p and the min_tokens mask), as vLLM reports them by default.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from r3srv.engine.sequence import Sequence


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


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) what top-k and top-p exclude; `logits` is 1-D, already temperature-scaled."""
    if top_k > 0 and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, stable=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass before it already reaches top_p (the first always stays).
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        logits = logits.clone()
        logits[order[drop]] = float("-inf")
    return logits


def sample(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: list[int]) -> list[SampleResult]:
    """One token for each row of `logits` ([B, vocab], float32) and its sequence.

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
        for i, tok in zip(plain_greedy, torch.argmax(logits[plain_greedy], dim=-1).tolist()):
            token_ids[i] = tok
    plain = set(plain_greedy)
    others: list[int] = []
    picks: list[torch.Tensor] = []  # one 1-element tensor per row in `others`
    for i, seq in enumerate(seqs):
        if i in plain:
            continue
        p = seq.params
        row = logits[i]
        banned = _banned_ids(seq, eos_token_ids)
        if banned:
            row = row.clone()
            row[[b for b in banned if 0 <= b < row.numel()]] = float("-inf")
        if p.greedy:
            picks.append(torch.argmax(row, dim=0, keepdim=True))
        else:
            row = _filter_top_k_top_p(row / p.temperature, p.top_k, p.top_p)
            probs = torch.softmax(row, dim=-1)
            picks.append(torch.multinomial(probs, 1, generator=seq.generator))
        others.append(i)
    if picks:
        for i, tok in zip(others, torch.cat(picks).tolist()):
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
