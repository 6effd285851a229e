"""Sparse MoE block: router -> select_experts (captures ids) -> grouped expert matmuls.

A rank's experts (models/parallel.py's ExpertSlice) are stacked: w13 [E, 2I, H] (gate rows
then up rows), w2 [E, H, I].
The expert pass (`grouped_experts`) takes (token, expert, weight) pairs: every token's k slots
at one device, or the list of pairs an expert-parallel rank owns (models/parallel.py). On the
CPU it is one call into the Rust core (kernels/expert_pairs_cpu.py) at every batch size, where
that kernel applies. Otherwise it sorts the pairs by expert id, then runs every expert's MLP in
two grouped GEMMs (torch's grouped_mm) or, where that is slower or unsupported, one pair of
matmuls per expert that received tokens: no per-token Python loop either way. The exception is
a CPU step with fewer pairs than experts without the Rust kernel (a decode of a few sequences),
where nearly every expert gets one row: there each pair runs as two matrix-vector products,
skipping the sort.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from r3srv import settings
from r3srv.kernels.expert_pairs_cpu import expert_pairs
from r3srv.kernels.linear_cpu import linear
from r3srv.kernels.router import select_experts
from r3srv.models.config import ModelConfig
from r3srv.models.parallel import SINGLE, ColumnParallelLinear, ExpertSlice, ParallelState, RowParallelLinear, split_evenly


def silu_and_mul(h: torch.Tensor) -> torch.Tensor:
    """SwiGLU on [rows, 2I] gate-then-up projections."""
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def relu_squared(h: torch.Tensor) -> torch.Tensor:
    """Nemotron-H's non-gated expert activation on [rows, I] up projections."""
    return F.relu(h).square()


class Mlp(nn.Module):
    """down(act(gate_up(x))): a SwiGLU MLP (gate_up: gate rows then up rows) or Nemotron-H's
    non-gated relu^2 one (up rows alone), its intermediate size split over the tensor-parallel
    ranks (gate_up column-parallel, down row-parallel)."""

    def __init__(self, hidden: int, intermediate: int, *, gated: bool, parallel: ParallelState = SINGLE,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        piece = split_evenly(intermediate, parallel.tp_rank, parallel.tp_size)
        self.gated = gated
        self.gate_up = ColumnParallelLinear(hidden, (piece,) * (2 if gated else 1), dtype=dtype, device=device)
        self.down = RowParallelLinear(piece, hidden, state=parallel, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down((silu_and_mul if self.gated else relu_squared)(self.gate_up(x)))


def clamped_swiglu(h: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's expert activation on [rows, 2I] interleaved gate/up projections."""
    gate, up = h[..., ::2].clamp(max=limit), h[..., 1::2].clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def grouped_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    *,
    tokens: torch.Tensor | None = None,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    act: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul,
) -> torch.Tensor:
    """sum over pairs p of token t: weights[p] * expert_{ids[p]}(x[t]), for every row t of x [T, H].

    The pairs are every token's k slots (ids/weights [T, k]) or, given `tokens`, a list of
    (tokens[p], ids[p], weights[p]) ([P] each: an expert-parallel rank's own pairs). Ids index
    w13/w2. An expert is down(act(gate_up(x) + b13)) + b2; the biases ([E, 2I], [E, H]) are
    optional (b2 alone too: a split expert adds it on one rank)."""
    if not ids.numel():
        return torch.zeros_like(x)
    if not x.is_cuda:
        fused = expert_pairs(x, w13, w2, weights, ids, tokens, b13, b2, act)  # the Rust kernel, where it applies
        if fused is not None:
            return fused
    grid = tokens is None  # every slot of every token: ids [T, k]
    top_k = ids.shape[-1] if grid else 1
    flat_ids, flat_weights = ids.reshape(-1).long(), weights.reshape(-1)
    if not x.is_cuda and flat_ids.numel() < w13.shape[0]:
        pair_tokens = torch.arange(x.shape[0]).repeat_interleave(top_k) if grid else tokens
        out = _expert_pairs(x, w13, w2, flat_weights, flat_ids, pair_tokens, b13, b2, act)
        if grid:  # a token's k rows are adjacent: summed in one reduction
            return out.view(*ids.shape, -1).sum(1)
        return torch.zeros_like(x).index_add_(0, pair_tokens, out)
    order = torch.argsort(flat_ids, stable=True)
    token_of_row = order // top_k if grid else tokens.index_select(0, order)
    # rows per expert; not torch.bincount, which on CUDA reads the largest id back to the host
    counts = flat_ids.new_zeros(w13.shape[0]).index_add_(0, flat_ids, torch.ones_like(flat_ids))
    rows = x.index_select(0, token_of_row)
    biases = None if b13 is None else (b13, b2, flat_ids[order])
    if uses_grouped_mm(rows, w2):
        out = _expert_mlps_grouped(rows, w13, w2, counts, act, biases)
    else:
        out = _expert_mlps_looped(rows, w13, w2, counts, act, biases)
    out.mul_(flat_weights[order].to(out.dtype)[:, None])
    return torch.zeros_like(x).index_add_(0, token_of_row, out)


def _expert_pairs(x, w13, w2, weights, ids, tokens, b13, b2, act) -> torch.Tensor:
    """The weighted outputs of the pairs (tokens[p], ids[p]), one pair at a time: torch.mv
    reads an expert's weights once per pair at less cost than a one-row F.linear, and no sort
    or gather is needed (the CPU's answer for a few tokens; ids are read to the host)."""
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


def uses_grouped_mm(rows: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether the expert pass runs as two grouped GEMMs instead of a loop over experts.

    On CUDA: for bfloat16 (the grouped GEMM kernels' dtype), where it also saves the loop's
    device sync. On the CPU (torch's reference grouped_mm: the same per-group matmuls, bitwise
    equal results) it pays off between about 1 and 16 rows per expert (docs/benchmarks.md,
    benches/bench_moe.py). With fewer rows (a one-sequence decode) most groups are empty and
    the loop skips them; with many (a long prefill) the loop's per-expert matmuls are as fast
    or faster.
    Either way every row of every operand must start on a 16-byte boundary, as grouped_mm
    requires.
    """
    if _GROUPED_MM is None or not settings.current().grouped_mm:
        return False
    num_experts, hidden, inter = w2.shape
    if (hidden * rows.element_size()) % 16 or (inter * rows.element_size()) % 16:
        return False
    if rows.is_cuda:
        return rows.dtype == torch.bfloat16
    return num_experts <= rows.shape[0] <= 16 * num_experts


def _expert_mlps_grouped(rows, w13, w2, counts, act=silu_and_mul, biases=None) -> torch.Tensor:
    offs = torch.cumsum(counts, dim=0, dtype=torch.int32)  # stays on the device: no sync
    h = _GROUPED_MM(rows, w13.transpose(1, 2), offs=offs)
    if biases is not None:
        h = h + biases[0].index_select(0, biases[2])
    out = _GROUPED_MM(act(h), w2.transpose(1, 2), offs=offs)
    if biases is not None and biases[1] is not None:
        out = out + biases[1].index_select(0, biases[2])
    return out


def _expert_mlps_looped(rows, w13, w2, counts, act=silu_and_mul, biases=None) -> torch.Tensor:
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


_GROUPED_MM = getattr(F, "grouped_mm", None)  # absent from older torch releases
class SparseMoeBlock(nn.Module):
    """Routed experts, plus a shared expert when the config has one (Qwen2-MoE: sigmoid-gated;
    GLM-4.5: ungated). Experts are SwiGLU MLPs (w13 holds gate and up rows), gpt-oss's clamped
    variant, or Nemotron-H's non-gated relu^2 MLPs (w13 holds the up rows only)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                 parallel: ParallelState = SINGLE) -> None:
        super().__init__()
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        kw = dict(dtype=dtype, device=device)
        self.top_k = cfg.top_k
        self.renormalize = cfg.router.renormalize
        self.scoring = cfg.router.scoring
        self.scaling = cfg.router.scaling
        self.num_groups, self.topk_groups = cfg.router.num_groups, cfg.router.topk_groups
        self.group_score_top = cfg.router.group_score_top
        # A float32 router keeps the checkpoint's routing exact in a bf16 model: the reference
        # implementations compute these logits in float32, and the correction bias is stored
        # in float32 (rounding it to bf16 would change which experts win).
        router_dtype = torch.float32 if cfg.router.float32 else dtype
        self.gate = nn.Parameter(torch.empty(e, h, dtype=router_dtype, device=device), requires_grad=False)
        self.gate_bias = (
            nn.Parameter(torch.empty(e, dtype=router_dtype, device=device), requires_grad=False)
            if cfg.router.logit_bias else None
        )
        self.correction_bias = (
            nn.Parameter(torch.empty(e, dtype=torch.float32, device=device), requires_grad=False)
            if cfg.router.correction_bias else None
        )
        gated = cfg.experts.gated
        gpt_oss = cfg.experts.activation == "clamped_swiglu"  # biased experts, gate/up rows interleaved in w13
        self.experts = ExpertSlice(e, h, i, gated=gated, interleaved=gpt_oss, biased=gpt_oss, state=parallel, **kw)
        self.act: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul if gated else relu_squared
        if gpt_oss:
            self.act = functools.partial(clamped_swiglu, alpha=cfg.experts.swiglu_alpha, limit=cfg.experts.swiglu_limit)
        self.expert_pass = functools.partial(grouped_experts, act=self.act)
        self.shared = self.shared_gate = None
        s = cfg.experts.shared_intermediate_size
        if s:
            self.shared = Mlp(h, s, gated=gated, parallel=parallel, **kw)
            if cfg.experts.shared_gate:
                self.shared_gate = nn.Parameter(torch.empty(1, h, **kw), requires_grad=False)

    def forward(self, x: torch.Tensor, capture: torch.Tensor | None) -> torch.Tensor:
        gate = self.gate
        router_logits = linear(x if x.dtype == gate.dtype else x.to(gate.dtype), gate, self.gate_bias)
        weights, ids = select_experts(
            router_logits,
            self.top_k,
            scoring=self.scoring,
            renormalize=self.renormalize,
            correction_bias=self.correction_bias,
            scaling=self.scaling,
            capture=capture,
            num_groups=self.num_groups,
            topk_groups=self.topk_groups,
            group_score_top=self.group_score_top,
        )
        out = self.experts(x, weights, ids, self.expert_pass)
        if self.shared is not None:
            shared = self.shared(x)
            out = out + (shared if self.shared_gate is None else torch.sigmoid(F.linear(x, self.shared_gate)) * shared)
        return out
