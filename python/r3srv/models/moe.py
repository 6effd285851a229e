"""Sparse MoE block: router -> select_experts (captures ids) -> grouped expert matmuls.

Experts are stacked at load time: w13 [E, 2I, H] (gate rows then up rows), w2 [E, H, I].
The expert pass sorts the (token, slot) pairs by expert id and runs one pair of matmuls per
expert that received tokens: no per-token Python loop.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from r3srv.kernels.router import select_experts
from r3srv.models.config import ModelConfig
from r3srv.models.layers import silu_mlp


def grouped_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]) for every token t. x [T, H]; ids/weights [T, k]."""
    num_tokens, top_k = ids.shape
    flat_ids = ids.reshape(-1).long()
    order = torch.argsort(flat_ids, stable=True)
    token_of_row = order // top_k
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    rows = x.index_select(0, token_of_row)
    out = torch.empty_like(rows)
    start = 0
    for expert, count in enumerate(counts):
        if count:
            end = start + count
            out[start:end] = silu_mlp(rows[start:end], w13[expert], w2[expert])
            start = end
    out.mul_(weights.reshape(-1)[order].to(out.dtype)[:, None])
    return torch.zeros_like(x).index_add_(0, token_of_row, out)


class SparseMoeBlock(nn.Module):
    """Routed experts, plus the Qwen2-MoE shared expert when the config has one."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        kw = dict(dtype=dtype, device=device)
        self.top_k = cfg.top_k
        self.renormalize = cfg.renormalize
        self.gate = nn.Parameter(torch.empty(e, h, **kw), requires_grad=False)
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, h, **kw), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(e, h, i, **kw), requires_grad=False)
        self.shared_w13 = self.shared_w2 = self.shared_gate = None
        s = cfg.shared_expert_intermediate_size
        if s:
            self.shared_w13 = nn.Parameter(torch.empty(2 * s, h, **kw), requires_grad=False)
            self.shared_w2 = nn.Parameter(torch.empty(h, s, **kw), requires_grad=False)
            self.shared_gate = nn.Parameter(torch.empty(1, h, **kw), requires_grad=False)

    def forward(self, x: torch.Tensor, capture: torch.Tensor | None) -> torch.Tensor:
        router_logits = F.linear(x, self.gate)
        weights, ids = select_experts(
            router_logits, self.top_k, scoring="softmax", renormalize=self.renormalize, capture=capture
        )
        out = grouped_experts(x, self.w13, self.w2, weights, ids)
        if self.shared_w13 is not None:
            shared = silu_mlp(x, self.shared_w13, self.shared_w2)
            out = out + torch.sigmoid(F.linear(x, self.shared_gate)) * shared
        return out
