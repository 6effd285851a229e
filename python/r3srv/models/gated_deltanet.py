"""Gated DeltaNet: the linear-attention layers of Qwen3-Next and Qwen3.5 (hybrid models).

A linear layer keeps, per sequence, a fixed-size state instead of a growing KV cache: the
last `kernel - 1` inputs of its causal depthwise convolution and a recurrent matrix S
[value heads, key dim, value dim] (float32). Per token t (per value head), with decay
g_t <= 0 and write strength beta_t in (0, 1):

    S_t = exp(g_t) S_{t-1} + k_t u_t^T,   u_t = beta_t (v_t - exp(g_t) S_{t-1}^T k_t),   o_t = S_t^T q_t

Decodes take that step directly (`recurrent_step`). Prefill chunks use the equivalent chunked
form (`chunked_delta_rule`, after the DeltaNet papers): inside a chunk of C tokens the writes U
solve one unit lower-triangular system, so a chunk is a few [C, C] and [C, d] matmuls.

Its states live in the pool entries models/recurrent.py describes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from r3srv.models.config import ModelConfig
from r3srv.models.layers import empty_param
from r3srv.models.parallel import SINGLE, ColumnParallelLinear, ParallelState, RowParallelLinear, column_weight, split_evenly
from r3srv.models.recurrent import LinearStateBatch, RecurrentLayer, causal_conv

CHUNK = 64  # tokens per chunk of the chunked form


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (the reference kernels' definition)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def recurrent_step(state, q, k, v, g, beta):
    """One token per sequence. state [B, H, dk, dv] float32 (updated in place); q, k [B, H, dk]
    (q already scaled); v [B, H, dv]; g, beta [B, H]. Returns o [B, H, dv]."""
    state.mul_(g.exp()[..., None, None])
    u = beta[..., None] * (v - torch.einsum("bhkv,bhk->bhv", state, k))
    state.add_(k[..., :, None] * u[..., None, :])
    return torch.einsum("bhkv,bhk->bhv", state, q)


def chunked_delta_rule(state, q, k, v, g, beta, chunk: int = CHUNK, captures=()):
    """L tokens of each sequence (any leading batch dims). state [..., H, dk, dv] float32
    (replaced in place by the final states); q, k [..., H, L, dk] (q scaled); v [..., H, L, dv];
    g, beta [..., H, L]. captures: (b, position, target) with 4-D inputs: the state of batch
    member b after its first `position` tokens is copied into target. Returns o [..., H, L, dv].

    Within a chunk starting from state S0, with cumulative log decay c_i = g_1 + ... + g_i,
    the writes satisfy (I + A) U = beta V - diag(beta e^c) K S0 where A_ij = beta_i e^(c_i - c_j)
    k_i.k_j for j < i; then o_i = e^(c_i) S0^T q_i + sum_{j<=i} e^(c_i - c_j) (q_i.k_j) u_j and
    after m tokens the state is e^(c_m) S0 + sum_{j<=m} e^(c_m - c_j) k_j u_j^T. A token with
    beta = 0 and g = 0 (padding) leaves the state as it is.
    """
    length, dv = q.shape[-2], v.shape[-1]
    out = torch.empty_like(v)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    s = state
    for lo in range(0, length, chunk):
        hi = min(lo + chunk, length)
        n = hi - lo
        qc, kc, vc, bc = q[..., lo:hi, :], k[..., lo:hi, :], v[..., lo:hi, :], beta[..., lo:hi, None]
        c = g[..., lo:hi].cumsum(-1)  # [..., H, n]
        # e^(c_i - c_j) for j <= i; masked before exp, where the difference is positive
        decay = (c[..., :, None] - c[..., None, :]).masked_fill(~causal[:n, :n], float("-inf")).exp()
        a = (bc * kc) @ kc.transpose(-1, -2) * decay
        rhs = torch.cat((bc * vc, bc * c.exp()[..., None] * kc), dim=-1)
        solved = torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True)
        u = solved[..., :dv] - solved[..., dv:] @ s  # [..., H, n, dv]
        out[..., lo:hi, :] = (qc * c.exp()[..., None]) @ s + ((qc @ kc.transpose(-1, -2)) * decay) @ u
        for b, position, target in captures:
            if lo < position <= hi:
                m = position - lo
                cm = c[b, :, m - 1 : m]  # [H, 1]
                target.copy_(cm.exp()[..., None] * s[b]
                             + (kc[b, :, :m] * (cm - c[b, :, :m]).exp()[..., None]).transpose(-1, -2) @ u[b, :, :m])
        last = c[..., -1:]
        s = last.exp()[..., None] * s + (kc * (last - c).exp()[..., None]).transpose(-1, -2) @ u
    state.copy_(s)
    return out


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x over its last dim, times weight, gated by silu(z) (the reference order and casts)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * xf.to(x.dtype) * F.silu(z.float())).to(x.dtype)


class GatedDeltaNet(RecurrentLayer):
    """A linear-attention layer. Its input projection keeps the checkpoint's row order:
    Qwen3-Next's [q k v z per key head] then [b a per key head] ("qkvz_ba"), Qwen3.5's
    [q k v] [z] [b] [a] over all heads ("qkv_z_b_a"). A rank holds its key heads and their
    value heads: its slice of each of those sub-matrices."""

    FUSED_STEP = "delta_rule_step"

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                 parallel: ParallelState = SINGLE) -> None:
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.layout = cfg.linear.projection_layout
        nk, nv, tp = cfg.linear.num_key_heads, cfg.linear.num_value_heads, (parallel.tp_rank, parallel.tp_size)
        self.nk, self.nv = split_evenly(nk, *tp).local, split_evenly(nv, *tp).local
        self.dk, self.dv = cfg.linear.key_head_dim, cfg.linear.value_head_dim
        self.key_dim, self.value_dim = self.nk * self.dk, self.nv * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = cfg.linear.conv_kernel
        self.eps = cfg.norm.eps
        keys, values, heads = (split_evenly(n, *tp) for n in (nk * self.dk, nv * self.dv, nv))
        if self.layout == "qkvz_ba":  # rows grouped by key head: one contiguous slice of each tensor
            r = nv // nk
            in_pieces = (split_evenly(nk * (2 * self.dk + 2 * r * self.dv), *tp), split_evenly(nk * 2 * r, *tp))
        else:
            in_pieces = (keys, keys, values, values, heads, heads)
        self.in_proj = ColumnParallelLinear(cfg.hidden_size, in_pieces, **kw)
        self.conv = column_weight((keys, keys, values), 1, self.kernel, **kw)
        self.dt_bias = column_weight(heads, **kw)
        self.a_log = column_weight(heads, **kw)
        self.norm = empty_param(self.dv, **kw)
        self.out_proj = RowParallelLinear(values, cfg.hidden_size, state=parallel, **kw)

    def state_shapes(self):
        return (self.conv_dim, self.kernel - 1), (self.nv, self.dk, self.dv)

    # ---- checkpoint names -----------------------------------------------------------------
    def weight_targets(self, prefix: str) -> dict[str, torch.Tensor]:
        p = prefix + "linear_attn."
        targets = {
            p + "conv1d.weight": self.conv.part(), p + "dt_bias": self.dt_bias.part(), p + "A_log": self.a_log.part(),
            p + "norm.weight": self.norm, p + "out_proj.weight": self.out_proj.part(),
        }
        if self.layout == "qkvz_ba":
            targets[p + "in_proj_qkvz.weight"] = self.in_proj.part(0)
            targets[p + "in_proj_ba.weight"] = self.in_proj.part(1)
        else:  # q, k and v in one tensor: three sub-matrices, each split
            for name, pieces in {"qkv": (0, 2), "z": (3, 3), "b": (4, 4), "a": (5, 5)}.items():
                targets[p + f"in_proj_{name}.weight"] = self.in_proj.part(*pieces)
        return targets

    # ---- forward --------------------------------------------------------------------------
    def _split(self, proj: torch.Tensor):
        """(qkv [T, conv_dim] as q, k, v over all heads; z [T, nv, dv]; b, a [T, nv])."""
        t = proj.shape[0]
        qkvz_width = self.conv_dim + self.value_dim
        if self.layout == "qkv_z_b_a":
            qkv, z, b, a = proj.split([self.conv_dim, self.value_dim, self.nv, self.nv], dim=-1)
            return qkv, z.reshape(t, self.nv, self.dv), b, a
        r = self.nv // self.nk  # value heads per key head
        grouped = proj[:, :qkvz_width].reshape(t, self.nk, 2 * self.dk + 2 * r * self.dv)
        q, k, v, z = grouped.split([self.dk, self.dk, r * self.dv, r * self.dv], dim=-1)
        b, a = proj[:, qkvz_width:].reshape(t, self.nk, 2 * r).split([r, r], dim=-1)
        qkv = torch.cat((q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)), dim=-1)
        return qkv, z.reshape(t, self.nv, self.dv), b.reshape(t, self.nv), a.reshape(t, self.nv)

    def forward(self, x: torch.Tensor, states: LinearStateBatch) -> torch.Tensor:
        self.begin_step(states)
        t = x.shape[0]
        qkv, z, b, a = self._split(self.in_proj(x))
        qkv = causal_conv(self.conv_state, qkv, self.conv.weight[:, 0], None, states)
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        r = self.nv // self.nk
        q = l2_normalize(q.float().reshape(t, self.nk, self.dk)).repeat_interleave(r, dim=1) * self.dk**-0.5
        k = l2_normalize(k.float().reshape(t, self.nk, self.dk)).repeat_interleave(r, dim=1)
        v = v.float().reshape(t, self.nv, self.dv)
        beta = b.float().sigmoid()
        g = -self.a_log.weight.float().exp() * F.softplus(a.float() + self.dt_bias.weight.float())
        o = torch.empty(t, self.nv, self.dv, dtype=torch.float32, device=x.device)

        def step(s, rows):
            return recurrent_step(s, q[rows], k[rows], v[rows], g[rows], beta[rows])

        def scan(s, group, captures):  # heads before tokens: [G, H, L, ...]
            padded = (group.pad(y).transpose(1, 2) for y in (q, k, v, g, beta))
            return chunked_delta_rule(s, *padded, captures=captures).transpose(1, 2)

        self.recur(states, o, step, scan, (q, k, v, g, beta))
        o = gated_rms_norm(o.to(x.dtype), z, self.norm, self.eps)
        return self.out_proj(o.reshape(t, self.value_dim))
