"""LFM2's short convolution (LFM2-MoE): the gated depthwise convolution its "conv" layers run
instead of attention.

in_proj splits each token into B, C and x; the layer returns out_proj(C * conv(B * x)), conv a
causal depthwise convolution over the last `kernel` values of B * x (no activation). Per
sequence the state is only the convolution's window, the last kernel - 1 values of B * x, kept
in the pool entries models/recurrent.py describes (snapshots and prefix caching included).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from r3srv.models.config import ModelConfig
from r3srv.models.layers import empty_param
from r3srv.models.recurrent import LinearStateBatch, RecurrentLayer, causal_conv, linear_targets, snapshot_steps


class ShortConv(RecurrentLayer):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        hidden = cfg.hidden_size
        self.in_proj = empty_param(3 * hidden, hidden, **kw)
        self.conv_weight = empty_param(hidden, 1, cfg.linear.conv_kernel, **kw)
        self.out_proj = empty_param(hidden, hidden, **kw)
        biased = cfg.linear.conv_bias
        self.in_proj_bias = empty_param(3 * hidden, **kw) if biased else None
        self.conv_bias = empty_param(hidden, **kw) if biased else None
        self.out_proj_bias = empty_param(hidden, **kw) if biased else None

    def state_shapes(self):
        return (self.conv_weight.shape[0], self.conv_weight.shape[-1] - 1), None

    def weight_targets(self, prefix: str) -> dict[str, torch.Tensor]:
        return linear_targets(prefix + "conv.", {"in_proj": (self.in_proj, self.in_proj_bias),
                                                 "conv": (self.conv_weight, self.conv_bias),
                                                 "out_proj": (self.out_proj, self.out_proj_bias)})

    def forward(self, x: torch.Tensor, states: LinearStateBatch) -> torch.Tensor:
        self.begin_step(states)
        b, c, h = F.linear(x, self.in_proj, self.in_proj_bias).chunk(3, dim=-1)
        y = c * causal_conv(self.conv_state, b * h, self.conv_weight[:, 0], self.conv_bias, states, silu=False)
        snapshot_steps(self.pools(), states)  # the one-token sequences that completed a block
        return F.linear(y, self.out_proj, self.out_proj_bias)
