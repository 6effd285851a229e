"""An independent float64 numpy implementation of vLLM's sampling filters, one row at a time:
the oracle the sampling-mask and logprobs-mode tests hold the sampler's numbers against; and
a fixture recording the logits the engine's sampler receives."""

from __future__ import annotations

import numpy as np
import pytest

from r3srv import SamplingParams
from r3srv.engine import executor


@pytest.fixture
def recorded(monkeypatch):
    """The logits rows every sampler call of the test receives, in order (one request at a time),
    as float64 arrays."""
    rows: list[np.ndarray] = []
    real = executor.sample

    def record(logits, seqs, *args, **kwargs):
        rows.extend(logits.float().numpy().astype(np.float64))
        return real(logits, seqs, *args, **kwargs)

    monkeypatch.setattr(executor, "sample", record)
    return rows


def processed_logits(logits: np.ndarray, p: SamplingParams, prompt: list[int], output: list[int],
                     eos: list[int]) -> np.ndarray:
    """The logits a pick reads after vLLM's processing, float64: the min_tokens bans, logit_bias
    and penalties; then, unless greedy (temperature below 1e-5), the temperature, min_p, top-k and
    top-p (stable, ties by id), a filtered-out token at -inf."""
    x = logits.astype(np.float64)
    if len(output) < p.min_tokens:
        x[list(p.stop_token_ids or []) + eos] = -np.inf
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    for t in set(prompt) | set(output) if p.repetition_penalty != 1.0 else ():
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(output):
        x[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    if p.temperature < 1e-5:
        return x
    x = x / p.temperature
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    if p.min_p > 0:
        x[probs < p.min_p * probs.max()] = -np.inf
    if 0 < p.top_k < len(x):
        x[x < np.sort(x)[::-1][p.top_k - 1]] = -np.inf
    if p.top_p < 1.0:
        order = sorted(range(len(x)), key=lambda t: (-x[t], t))
        probs = np.exp(x - x.max())
        probs /= probs.sum()
        before = 0.0
        for t in order:
            if before >= p.top_p:
                x[t] = -np.inf
            before += probs[t]
    return x


def log_softmax(x: np.ndarray) -> np.ndarray:
    """float64 log-softmax of one row; -inf entries stay -inf."""
    top = x[np.isfinite(x)].max()
    return x - (top + np.log(np.exp(x - top).sum()))


def reference_support(logits: np.ndarray, p: SamplingParams, prompt: list[int], output: list[int],
                      eos: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(ids the draw can pick, ascending; their logprobs): a greedy pick alone at 0.0."""
    x = processed_logits(logits, p, prompt, output, eos)
    if p.temperature < 1e-5:
        return np.array([int(np.argmax(x))]), np.zeros(1)
    keep = np.flatnonzero(np.isfinite(x))
    return keep, log_softmax(x)[keep]
