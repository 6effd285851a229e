"""The expert pass: sum over pairs p of token t: weights[p] * expert_{ids[p]}(x[t]).

An expert is down(act(gate_up(x) + b13)) + b2 over stacked weights w13 [E, (2) I, H] (gate rows
then up rows, gpt-oss's interleaved pairs, or up rows alone) and w2 [E, H, I]; the biases are
optional (b2 alone too: a split expert adds it on one rank). The pairs are every token's k
slots (ids/weights [T, k]) or, given `tokens`, a list of (tokens[p], ids[p], weights[p]) ([P]
each: an expert-parallel rank's own pairs).

`Activation` says which activation as data, so that every backend reads the same description
(the Rust kernel takes its name and constants; the torch paths call it). Backends build the pass
once per layer (`ExpertPass`): the Rust kernel on the CPU (ops/cpu.py), torch's paths below
otherwise. The torch pass sorts the pairs by expert id and runs every expert's MLP in two
grouped GEMMs (torch's grouped_mm) or, where that is slower or unsupported, one pair of matmuls
per expert that received rows: no per-token Python loop either way. On the CPU, a step with
fewer pairs than experts (a decode of a few sequences) runs each pair as two matrix-vector
products instead, skipping the sort.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

ACTIVATIONS = ("silu_and_mul", "relu_squared", "clamped_swiglu")


def silu_and_mul(h: torch.Tensor) -> torch.Tensor:
    """SwiGLU on [rows, 2I] gate-then-up projections."""
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def relu_squared(h: torch.Tensor) -> torch.Tensor:
    """Nemotron-H's non-gated expert activation on [rows, I] up projections."""
    return F.relu(h).square()


def clamped_swiglu(h: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's expert activation on [rows, 2I] interleaved gate/up projections."""
    gate, up = h[..., ::2].clamp(max=limit), h[..., 1::2].clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


@dataclass(frozen=True)
class Activation:
    """An expert (or MLP) activation: "silu_and_mul" (gate rows then up rows), "relu_squared"
    (up rows alone) or "clamped_swiglu" (gpt-oss's interleaved rows, with alpha and limit)."""

    name: str = "silu_and_mul"
    alpha: float = 0.0
    limit: float = 0.0

    def __post_init__(self) -> None:
        if self.name not in ACTIVATIONS:
            raise ValueError(f"unknown activation {self.name!r}; expected one of {ACTIVATIONS}")

    @property
    def gated(self) -> bool:
        """Whether w13 holds gate and up rows (2I of them) rather than up rows alone."""
        return self.name != "relu_squared"

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        if self.name == "silu_and_mul":
            return silu_and_mul(h)
        if self.name == "relu_squared":
            return relu_squared(h)
        return clamped_swiglu(h, self.alpha, self.limit)


SILU_AND_MUL = Activation("silu_and_mul")
RELU_SQUARED = Activation("relu_squared")

# (x, w13, w2, weights, ids, *, tokens=None, b13=None, b2=None) -> [T, H]
ExpertPass = Callable[..., torch.Tensor]

_GROUPED_MM = getattr(F, "grouped_mm", None)  # absent from older torch releases


def grouped_mm_available() -> bool:
    return _GROUPED_MM is not None


@dataclass(frozen=True)
class TorchExperts:
    """The torch expert pass of one activation on one kind of device.

    pairs_mv: a step with fewer pairs than experts runs pair by pair (two torch.mv each: the
    CPU's answer for a few tokens, which reads the ids on the host). grouped: where the two
    grouped GEMMs run instead of the per-expert loop: None (never), "cuda" (bfloat16 rows, the
    grouped kernels' dtype, which also saves the loop's device sync) or "cpu" (torch's reference
    grouped_mm, bitwise equal to the loop: it pays between about 1 and 16 rows per expert,
    docs/benchmarks.md, benches/bench_moe.py)."""

    act: Activation = SILU_AND_MUL
    pairs_mv: bool = False
    grouped: str | None = None
    pairs_mv_always: bool = False  # pair by pair at any count (the batch-invariant backend's fallback)

    def __call__(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                 ids: torch.Tensor, *, tokens: torch.Tensor | None = None, b13: torch.Tensor | None = None,
                 b2: torch.Tensor | None = None) -> torch.Tensor:
        if not ids.numel():
            return torch.zeros_like(x)
        act = self.act
        grid = tokens is None  # every slot of every token: ids [T, k]
        top_k = ids.shape[-1] if grid else 1
        flat_ids, flat_weights = ids.reshape(-1).long(), weights.reshape(-1)
        if self.pairs_mv and (self.pairs_mv_always or flat_ids.numel() < w13.shape[0]):
            pair_tokens = torch.arange(x.shape[0]).repeat_interleave(top_k) if grid else tokens
            out = expert_pairs_mv(x, w13, w2, flat_weights, flat_ids, pair_tokens, b13, b2, act)
            if grid:  # a token's k rows are adjacent: summed in one reduction
                return out.view(*ids.shape, -1).sum(1)
            return torch.zeros_like(x).index_add_(0, pair_tokens, out)
        order = torch.argsort(flat_ids, stable=True)
        token_of_row = order // top_k if grid else tokens.index_select(0, order)
        # rows per expert; not torch.bincount, which on CUDA reads the largest id back to the host
        counts = flat_ids.new_zeros(w13.shape[0]).index_add_(0, flat_ids, torch.ones_like(flat_ids))
        rows = x.index_select(0, token_of_row)
        biases = None if b13 is None else (b13, b2, flat_ids[order])
        if self.uses_grouped_mm(rows, w2):
            out = expert_mlps_grouped(rows, w13, w2, counts, act, biases)
        else:
            out = expert_mlps_looped(rows, w13, w2, counts, act, biases)
        out.mul_(flat_weights[order].to(out.dtype)[:, None])
        return torch.zeros_like(x).index_add_(0, token_of_row, out)

    def uses_grouped_mm(self, rows: torch.Tensor, w2: torch.Tensor) -> bool:
        """Whether `rows` (the pairs' inputs sorted by expert) take the two grouped GEMMs rather
        than the loop over experts: every row of every operand must start on a 16-byte
        boundary, as grouped_mm requires; see the class docstring for the rest."""
        if self.grouped is None or _GROUPED_MM is None:
            return False
        num_experts, hidden, inter = w2.shape
        if (hidden * rows.element_size()) % 16 or (inter * rows.element_size()) % 16:
            return False
        if self.grouped == "cuda":
            return rows.dtype == torch.bfloat16
        # fewer rows (a one-sequence decode): most groups are empty and the loop skips them;
        # more (a long prefill): the loop's per-expert matmuls are as fast or faster
        return num_experts <= rows.shape[0] <= 16 * num_experts


def expert_pairs_mv(x, w13, w2, weights, ids, tokens, b13, b2, act) -> torch.Tensor:
    """The weighted outputs of the pairs (tokens[p], ids[p]), one pair at a time: torch.mv
    reads an expert's weights once per pair at less cost than a one-row F.linear, and no sort
    or gather is needed (ids are read to the host)."""
    pairs = list(zip(tokens.tolist(), ids.tolist()))
    num_pairs = len(pairs)
    h = x.new_empty(num_pairs, w13.shape[1])
    for row, (token, expert) in enumerate(pairs):
        torch.mv(w13[expert], x[token], out=h[row])
    if b13 is not None:
        h = h + b13.index_select(0, ids)
    h = act(h)
    out = x.new_empty(num_pairs, w2.shape[1])
    for row, (_, expert) in enumerate(pairs):
        torch.mv(w2[expert], h[row], out=out[row])
    if b2 is not None:
        out = out + b2.index_select(0, ids)
    return out.mul_(weights.reshape(-1, 1).to(out.dtype))


def expert_mlps_grouped(rows, w13, w2, counts, act=SILU_AND_MUL, biases=None) -> torch.Tensor:
    offs = torch.cumsum(counts, dim=0, dtype=torch.int32)  # stays on the device: no sync
    h = _GROUPED_MM(rows, w13.transpose(1, 2), offs=offs)
    if biases is not None:
        h = h + biases[0].index_select(0, biases[2])
    out = _GROUPED_MM(act(h), w2.transpose(1, 2), offs=offs)
    if biases is not None and biases[1] is not None:
        out = out + biases[1].index_select(0, biases[2])
    return out


def expert_mlps_looped(rows, w13, w2, counts, act=SILU_AND_MUL, biases=None) -> torch.Tensor:
    spans, start = [], 0
    for expert, count in enumerate(counts.tolist()):  # one device sync on CUDA
        if count:
            spans.append((expert, start, start + count))
            start += count
    # Projections per expert; biases and the activation over all rows at once, as the grouped
    # path applies them (elementwise kernels may round a slice's tail differently).
    h = rows.new_empty(rows.shape[0], w13.shape[1])
    for expert, begin, end in spans:
        h[begin:end] = F.linear(rows[begin:end], w13[expert])
    if biases is not None:
        h = h + biases[0].index_select(0, biases[2])
    h = act(h)
    out = torch.empty_like(rows)
    for expert, begin, end in spans:
        out[begin:end] = F.linear(h[begin:end], w2[expert])
    return out if biases is None or biases[1] is None else out + biases[1].index_select(0, biases[2])


def shared_expert_gate(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A shared expert's gate, sigmoid(x @ weight^T): [T, 1] for weight [1, H]."""
    return torch.sigmoid(F.linear(x, weight))


@dataclass(frozen=True)
class KernelExperts:
    """A kernel's expert pass (`kernel(..., act)`: its result, or None where it does not
    apply), the torch pass `fallback` where it declines."""

    kernel: Callable[..., torch.Tensor | None]
    fallback: TorchExperts

    def __call__(self, x, w13, w2, weights, ids, *, tokens=None, b13=None, b2=None) -> torch.Tensor:
        if ids.numel():
            out = self.kernel(x, w13, w2, weights, ids, tokens, b13, b2, self.fallback.act)
            if out is not None:
                return out
        return self.fallback(x, w13, w2, weights, ids, tokens=tokens, b13=b13, b2=b2)
