"""Kimi Delta Attention (KDA): the linear-attention layers of Kimi-Linear.

The gated delta rule of models/gated_deltanet.py with a decay per key channel instead of per
head: per token, with g_t in R^dk (<= 0) and write strength beta_t,

    S_t = Diag(e^g_t) S_{t-1} + k_t u_t^T,   u_t = beta_t (v_t - (Diag(e^g_t) S_{t-1})^T k_t),   o_t = S_t^T q_t

Decodes take that step (`kda_step`); prefills the chunked form (`chunked_kda`), whose pairwise
decays are per channel ([n, n, dk] per head, so its chunks are shorter). The output is
normalised per head and gated by a sigmoid of a low-rank projection. States live in the pool
entries models/recurrent.py describes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from r3srv.models.config import ModelConfig
from r3srv.models.gated_deltanet import l2_normalize
from r3srv.models.layers import empty_param
from r3srv.models.parallel import (SINGLE, ColumnParallelLinear, ParallelState, RowParallelLinear, column_weight, reshaped,
                                   split_evenly)
from r3srv.models.recurrent import LinearStateBatch, RecurrentLayer, causal_conv

CHUNK = 32  # tokens per chunk: the pairwise decays take chunk^2 x dk per head


def kda_step(state, q, k, v, g, beta):
    """One token per sequence. state [B, H, dk, dv] float32 (updated in place); q, k [B, H, dk]
    (q scaled); v [B, H, dv]; g [B, H, dk]; beta [B, H]. Returns o [B, H, dv]."""
    state.mul_(g.exp()[..., None])
    u = beta[..., None] * (v - torch.einsum("bhkv,bhk->bhv", state, k))
    state.add_(k[..., :, None] * u[..., None, :])
    return torch.einsum("bhkv,bhk->bhv", state, q)


def chunked_kda(state, q, k, v, g, beta, chunk: int = CHUNK, captures=()):
    """L tokens of each sequence (any leading batch dims). state [..., H, dk, dv] float32
    (replaced in place by the final states); q, k [..., H, L, dk] (q scaled); v [..., H, L, dv];
    g [..., H, L, dk]; beta [..., H, L]. captures: (b, position, target) with 4-D inputs.
    Returns o [..., H, L, dv].

    Within a chunk from S0, with cumulative decays c_i = g_1 + ... + g_i (vectors) and
    P_ij = e^(c_i - c_j) for j <= i: (I + A) U = beta V - diag(beta) (K * e^C) S0 where
    A_ij = beta_i sum_d k_i[d] k_j[d] P_ij[d] (j < i); o_i = (q_i * e^c_i)^T S0 +
    sum_{j<=i} (sum_d q_i[d] k_j[d] P_ij[d]) u_j; after m tokens the state is
    Diag(e^c_m) S0 + sum_{j<=m} Diag(P_mj) k_j u_j^T. Padding (beta = 0, g = 0) is neutral.
    """
    length, dv = q.shape[-2], v.shape[-1]
    out = torch.empty_like(v)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    s = state
    for lo in range(0, length, chunk):
        hi = min(lo + chunk, length)
        n = hi - lo
        qc, kc, vc, bc = q[..., lo:hi, :], k[..., lo:hi, :], v[..., lo:hi, :], beta[..., lo:hi, None]
        c = g[..., lo:hi, :].cumsum(-2)  # [..., H, n, dk]
        diff = (c[..., :, None, :] - c[..., None, :, :]).masked_fill(~causal[:n, :n, None], float("-inf"))
        pair = diff.exp()  # [..., H, n, n, dk]
        a = bc * torch.einsum("...id,...jd,...ijd->...ij", kc, kc, pair)
        rhs = torch.cat((bc * vc, bc * kc * c.exp()), dim=-1)
        solved = torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True)
        u = solved[..., :dv] - solved[..., dv:] @ s  # [..., H, n, dv]
        scores = torch.einsum("...id,...jd,...ijd->...ij", qc, kc, pair)
        out[..., lo:hi, :] = (qc * c.exp()) @ s + scores @ u
        for b, position, target in captures:
            if lo < position <= hi:
                m = position - lo
                cm = c[b, :, m - 1 : m, :]  # [H, 1, dk]
                target.copy_(cm.exp().transpose(-1, -2) * s[b]
                             + (kc[b, :, :m] * (cm - c[b, :, :m]).exp()).transpose(-1, -2) @ u[b, :, :m])
        last = c[..., -1:, :]
        s = last.exp().transpose(-1, -2) * s + (kc * (last - c).exp()).transpose(-1, -2) @ u
    state.copy_(s)
    return out


class KimiDeltaAttention(RecurrentLayer):
    """A rank holds its heads: their rows of every per-head projection; the low-rank inputs
    (f_a, g_a) and the norm are whole."""

    FUSED_STEP = "delta_rule_step"

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                 parallel: ParallelState = SINGLE) -> None:
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        heads, self.dim = cfg.linear.num_value_heads, cfg.linear.value_head_dim
        tp = (parallel.tp_rank, parallel.tp_size)
        self.heads = split_evenly(heads, *tp).local
        self.width = self.heads * self.dim
        self.eps = cfg.norm.eps
        hidden = cfg.hidden_size
        width, per_head = split_evenly(heads * self.dim, *tp), split_evenly(heads, *tp)
        self.qkv = ColumnParallelLinear(hidden, (width,) * 3, **kw)
        self.conv = column_weight((width,) * 3, 1, cfg.linear.conv_kernel, **kw)
        self.f_a, self.f_b = empty_param(self.dim, hidden, **kw), ColumnParallelLinear(self.dim, width, **kw)
        self.dt_bias = column_weight(width, **kw)
        self.a_log = column_weight(per_head, **kw)
        self.b_proj = ColumnParallelLinear(hidden, per_head, **kw)
        self.g_a, self.g_b = empty_param(self.dim, hidden, **kw), ColumnParallelLinear(self.dim, width, **kw)
        self.o_norm = empty_param(self.dim, **kw)
        self.o_proj = RowParallelLinear(width, hidden, state=parallel, **kw)

    def state_shapes(self):
        return (3 * self.width, self.conv.weight.shape[-1] - 1), (self.heads, self.dim, self.dim)

    def weight_targets(self, prefix: str) -> dict[str, torch.Tensor]:
        """Released names (q/k/v_conv1d, f_a_proj, ...) and transformers 5's (one conv1d, forget_gate.*)."""
        p = prefix + "self_attn."
        targets = {p + "b_proj.weight": self.b_proj.part(), p + "g_a_proj.weight": self.g_a,
                   p + "g_b_proj.weight": self.g_b.part(), p + "o_norm.weight": self.o_norm,
                   p + "o_proj.weight": self.o_proj.part(), p + "conv1d.weight": self.conv.part()}
        for i, name in enumerate("qkv"):
            targets[p + f"{name}_proj.weight"] = self.qkv.part(i)
            targets[p + f"{name}_conv1d.weight"] = self.conv.part(i)
        gate = {"f_a_proj.weight": self.f_a, "f_b_proj.weight": self.f_b.part(), "dt_bias": self.dt_bias.part(),
                "A_log": reshaped(self.a_log.part(), 1, 1, self.heads, 1, dim=2)}
        for name, tensor in gate.items():
            targets[p + name] = targets[p + "forget_gate." + name] = tensor
        return targets

    def forward(self, x: torch.Tensor, states: LinearStateBatch) -> torch.Tensor:
        self.begin_step(states)
        t, h, d = x.shape[0], self.heads, self.dim
        qkv = causal_conv(self.conv_state, self.qkv(x), self.conv.weight[:, 0], None, states)
        q, k, v = (y.float().reshape(t, h, d) for y in qkv.split(self.width, dim=-1))
        q, k = l2_normalize(q) * d**-0.5, l2_normalize(k)
        raw = self.f_b(F.linear(x, self.f_a)).float() + self.dt_bias.weight.float()
        g = (-self.a_log.weight.float().exp()[:, None] * F.softplus(raw.view(t, h, d), threshold=20.0))
        beta = self.b_proj(x).float().sigmoid()
        o = torch.empty(t, h, d, dtype=torch.float32, device=x.device)

        def step(s, rows):
            return kda_step(s, q[rows], k[rows], v[rows], g[rows], beta[rows])

        def scan(s, group, captures):  # heads before tokens: [G, H, L, ...]
            padded = (group.pad(y).transpose(1, 2) for y in (q, k, v, g, beta))
            return chunked_kda(s, *padded, captures=captures).transpose(1, 2)

        self.recur(states, o, step, scan, (q, k, v, g, beta))
        gate = self.g_b(F.linear(x, self.g_a)).float().view(t, h, d)
        normed = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.eps) * self.o_norm.float()
        return self.o_proj((normed * gate.sigmoid()).to(x.dtype).reshape(t, self.width))
