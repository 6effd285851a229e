"""Mamba-2: the state-space layers of Nemotron-H (NVIDIA Nemotron 3 Nano) and Granite-4.0-H.

Per sequence a layer keeps the last `kernel - 1` inputs of its causal convolution and a state
S [heads, head_dim, state_size] (float32). Per token t and head, with step dt_t > 0, decay
A < 0 and input-dependent B_t, C_t (shared by the heads of a group):

    S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T,   y_t = S_t C_t + D x_t

Decodes take that step directly (`ssm_step`); prefills the chunked form (`chunked_scan`, the
state-space duality of the Mamba-2 paper): inside a chunk, y is a causally masked, decayed
product of C B^T with dt x, plus the chunk's initial state read through C. The output is
gated by silu(z) and normalised per group of heads. States live in the pool entries
models/recurrent.py describes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from r3srv.models.config import ModelConfig
from r3srv.models.parallel import SINGLE, ColumnParallelLinear, ParallelState, RowParallelLinear, column_weight, head_pieces
from r3srv.models.recurrent import LinearStateBatch, RecurrentLayer, causal_conv, linear_targets

CHUNK = 64  # tokens per chunk of the chunked form


def ssm_step(state, x, dt, a, b, c):
    """One token per sequence. state [B, H, P, N] float32 (updated in place); x [B, H, P];
    dt [B, H]; a [H] (< 0); b, c [B, H, N]. Returns y [B, H, P] (without the D skip)."""
    state.mul_((dt * a).exp()[..., None, None])
    state.add_((dt[..., None] * x)[..., None] * b[:, :, None, :])
    return torch.einsum("bhpn,bhn->bhp", state, c)


def chunked_scan(state, x, dt, a, b, c, chunk: int = CHUNK, captures=()):
    """L tokens of each sequence (any leading batch dims). state [..., H, P, N] float32 (replaced
    in place by the final states); x [..., H, L, P]; dt [..., H, L]; a [H]; b, c [..., H, L, N].
    captures: (member, position, target) with 4-D inputs: member's state after its first
    `position` tokens is copied into target. Returns y [..., H, L, P] (without the D skip).

    Within a chunk from state S0, with cumulative log decay s_i = a (dt_1 + ... + dt_i):
    y_i = e^(s_i) S0 c_i + sum_{j<=i} e^(s_i - s_j) (c_i . b_j) dt_j x_j, and after m tokens
    the state is e^(s_m) S0 + sum_{j<=m} e^(s_m - s_j) dt_j x_j b_j^T. A token with dt = 0
    (padding) leaves the state as it is.
    """
    length = x.shape[-2]
    out = torch.empty_like(x)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=x.device).tril()
    s = state
    for lo in range(0, length, chunk):
        hi = min(lo + chunk, length)
        n = hi - lo
        bc, cc = b[..., lo:hi, :], c[..., lo:hi, :]
        dx = dt[..., lo:hi, None] * x[..., lo:hi, :]  # [..., H, n, P]
        cum = (dt[..., lo:hi] * a[:, None]).cumsum(-1)  # [..., H, n]
        decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal[:n, :n], float("-inf")).exp()
        scores = (cc @ bc.transpose(-1, -2)) * decay  # [..., H, n, n]
        out[..., lo:hi, :] = scores @ dx + cum.exp()[..., None] * (cc @ s.transpose(-1, -2))
        for member, position, target in captures:
            if lo < position <= hi:
                m = position - lo
                cm = cum[member, :, m - 1 : m]  # [H, 1]
                target.copy_(cm.exp()[..., None] * s[member] + (
                    dx[member, :, :m] * (cm - cum[member, :, :m]).exp()[..., None]).transpose(-1, -2) @ bc[member, :, :m])
        last = cum[..., -1:]
        s = last.exp()[..., None] * s + (dx * (last - cum).exp()[..., None]).transpose(-1, -2) @ bc
    state.copy_(s)
    return out


class Mamba2(RecurrentLayer):
    """A rank holds its heads (their rows of in_proj, the convolution, the per-head vectors and
    the norm) and their groups' B and C rows."""

    FUSED_STEP = "ssm_step"

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                 parallel: ParallelState = SINGLE) -> None:
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        spec = cfg.linear
        heads, groups = spec.mamba_num_heads, spec.groups
        if groups % parallel.tp_size and parallel.tp_size % groups:
            raise ValueError(f"{groups} Mamba-2 groups neither split over nor replicate on {parallel.tp_size} ranks")
        self.parallel, self.total_groups = parallel, groups
        self.head_dim, self.state_size = spec.mamba_head_dim, spec.state_size
        per_head, inner = head_pieces(heads, 1, parallel), head_pieces(heads, self.head_dim, parallel)
        bc = head_pieces(groups, self.state_size, parallel)
        # fewer groups than ranks: each rank holds part of one group's heads (B and C replicated)
        self.heads, self.groups = per_head.local, max(1, groups // parallel.tp_size)
        self.inner = self.heads * self.head_dim
        self.conv_dim = self.inner + 2 * self.groups * self.state_size
        self.dt_min = spec.dt_min
        self.eps = cfg.norm.eps
        # in_proj: z, then the convolved x, B and C, then dt
        self.in_proj = ColumnParallelLinear(cfg.hidden_size, (inner, inner, bc, bc, per_head),
                                            bias=spec.proj_bias, **kw)
        self.conv = column_weight((inner, bc, bc), 1, spec.conv_kernel, bias=spec.conv_bias, **kw)
        self.dt_bias, self.a_log, self.d = (column_weight(per_head, **kw) for _ in range(3))
        self.norm = column_weight(inner, **kw)
        self.out_proj = RowParallelLinear(inner, cfg.hidden_size, bias=spec.proj_bias, state=parallel, **kw)

    def state_shapes(self):
        return (self.conv_dim, self.conv.weight.shape[-1] - 1), (self.heads, self.head_dim, self.state_size)

    def weight_targets(self, prefix: str, module: str = "mamba.") -> dict[str, torch.Tensor]:
        p = prefix + module
        vectors = {"dt_bias": self.dt_bias, "A_log": self.a_log, "D": self.d, "norm.weight": self.norm}
        return {p + name: vector.part() for name, vector in vectors.items()} | linear_targets(p, {
            name: (layer.part(), layer.bias_part())
            for name, layer in (("in_proj", self.in_proj), ("conv1d", self.conv), ("out_proj", self.out_proj))})

    def forward(self, x: torch.Tensor, states: LinearStateBatch) -> torch.Tensor:
        self.begin_step(states)
        t, h, p, n = x.shape[0], self.heads, self.head_dim, self.state_size
        z, xbc, dt = self.in_proj(x).split([self.inner, self.conv_dim, h], dim=-1)
        xbc = causal_conv(self.conv_state, xbc, self.conv.weight[:, 0], self.conv.bias, states)
        u, b, c = xbc.split([self.inner, self.groups * n, self.groups * n], dim=-1)
        u = u.float().reshape(t, h, p)
        per_group = h // self.groups
        b = b.float().reshape(t, self.groups, n).repeat_interleave(per_group, dim=1)  # [T, H, N]
        c = c.float().reshape(t, self.groups, n).repeat_interleave(per_group, dim=1)
        dt = F.softplus(dt.float() + self.dt_bias.weight.float()).clamp(min=self.dt_min)
        a = -self.a_log.weight.float().exp()
        y = torch.empty_like(u)

        def step(s, rows):
            return ssm_step(s, u[rows], dt[rows], a, b[rows], c[rows])

        def scan(s, group, captures):  # heads before tokens: [G, H, L, ...]
            xs, dts, bs, cs = (group.pad(v).transpose(1, 2) for v in (u, dt, b, c))
            return chunked_scan(s, xs, dts, a, bs, cs, captures=captures).transpose(1, 2)

        self.recur(states, y, step, scan, (u, dt, b, c), (a,))
        y = (y + self.d.weight.float()[:, None] * u).reshape(t, self.inner)
        return self.out_proj(self._gated_norm(y.to(x.dtype), z))

    def _gated_norm(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """RMSNorm of y * silu(z) over each group's heads (in float32), times the weight. A group
        split between ranks is gathered, normed whole, and this rank's part kept."""
        tp, t = self.parallel.tp_size, y.shape[0]
        spans = tp > self.total_groups
        g = y.float() * F.silu(z.float())
        g = (self.parallel.all_gather(g) if spans else g).view(t, self.total_groups if spans else self.groups, -1)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        g = g.view(t, -1).chunk(tp, dim=-1)[self.parallel.tp_rank] if spans else g.view(y.shape)
        return self.norm.weight * g.to(y.dtype)
