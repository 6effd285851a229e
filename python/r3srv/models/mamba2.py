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
from r3srv.models.layers import empty_param
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
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        spec = cfg.linear
        self.heads, self.head_dim = spec.mamba_num_heads, spec.mamba_head_dim
        self.state_size, self.groups = spec.state_size, spec.groups
        self.inner = self.heads * self.head_dim
        self.conv_dim = self.inner + 2 * self.groups * self.state_size
        self.dt_min = spec.dt_min
        self.eps = cfg.norm.eps
        self.in_proj = empty_param(self.inner + self.conv_dim + self.heads, cfg.hidden_size, **kw)
        self.in_proj_bias = empty_param(self.inner + self.conv_dim + self.heads, **kw) if spec.proj_bias else None
        self.conv_weight = empty_param(self.conv_dim, 1, spec.conv_kernel, **kw)
        self.conv_bias = empty_param(self.conv_dim, **kw) if spec.conv_bias else None
        self.dt_bias = empty_param(self.heads, **kw)
        self.a_log = empty_param(self.heads, **kw)
        self.d = empty_param(self.heads, **kw)
        self.norm = empty_param(self.inner, **kw)
        self.out_proj = empty_param(cfg.hidden_size, self.inner, **kw)
        self.out_proj_bias = empty_param(cfg.hidden_size, **kw) if spec.proj_bias else None

    def state_shapes(self):
        return (self.conv_dim, self.conv_weight.shape[-1] - 1), (self.heads, self.head_dim, self.state_size)

    def weight_targets(self, prefix: str, module: str = "mamba.") -> dict[str, torch.Tensor]:
        p = prefix + module
        return {p + "dt_bias": self.dt_bias, p + "A_log": self.a_log, p + "D": self.d, p + "norm.weight": self.norm} | (
            linear_targets(p, {"in_proj": (self.in_proj, self.in_proj_bias), "conv1d": (self.conv_weight, self.conv_bias),
                               "out_proj": (self.out_proj, self.out_proj_bias)}))

    def forward(self, x: torch.Tensor, states: LinearStateBatch) -> torch.Tensor:
        self.begin_step(states)
        t, h, p, n = x.shape[0], self.heads, self.head_dim, self.state_size
        z, xbc, dt = F.linear(x, self.in_proj, self.in_proj_bias).split([self.inner, self.conv_dim, h], dim=-1)
        xbc = causal_conv(self.conv_state, xbc, self.conv_weight[:, 0], self.conv_bias, states)
        u, b, c = xbc.split([self.inner, self.groups * n, self.groups * n], dim=-1)
        u = u.float().reshape(t, h, p)
        per_group = h // self.groups
        b = b.float().reshape(t, self.groups, n).repeat_interleave(per_group, dim=1)  # [T, H, N]
        c = c.float().reshape(t, self.groups, n).repeat_interleave(per_group, dim=1)
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(min=self.dt_min)
        a = -self.a_log.float().exp()
        y = torch.empty_like(u)

        def step(s, rows):
            return ssm_step(s, u[rows], dt[rows], a, b[rows], c[rows])

        def scan(s, group, captures):  # heads before tokens: [G, H, L, ...]
            xs, dts, bs, cs = (group.pad(v).transpose(1, 2) for v in (u, dt, b, c))
            return chunked_scan(s, xs, dts, a, bs, cs, captures=captures).transpose(1, 2)

        self.recur(states, y, step, scan, fused=("ssm_step_triton", (u, dt, b, c), (a,)))
        y = (y + self.d.float()[:, None] * u).reshape(t, self.inner)
        return F.linear(self._gated_norm(y.to(x.dtype), z), self.out_proj, self.out_proj_bias)

    def _gated_norm(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """RMSNorm of y * silu(z) over each group's heads (in float32), times the weight."""
        g = (y.float() * F.silu(z.float())).view(y.shape[0], self.groups, -1)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.norm * g.view(y.shape).to(y.dtype)
