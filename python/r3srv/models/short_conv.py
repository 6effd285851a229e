"""LFM2's short convolution (LFM2-MoE): the gated depthwise convolution its "conv" layers run
instead of attention.

in_proj splits each token into B, C and x; the layer returns out_proj(C * conv(B * x)), conv a
causal depthwise convolution over the last `kernel` values of B * x (no activation). Per
sequence the state is only the convolution's window, the last kernel - 1 values of B * x, kept
in the pool entries models/recurrent.py describes (snapshots and prefix caching included).
"""

from __future__ import annotations

import torch

from r3srv.models.config import ModelConfig
from r3srv.models.parallel import SINGLE, ColumnParallelLinear, ParallelState, RowParallelLinear, column_weight, split_evenly
from r3srv.models.recurrent import LinearStateBatch, RecurrentLayer, causal_conv, linear_targets, snapshot_steps


class ShortConv(RecurrentLayer):
    """A rank holds its slice of the channels: of B, C and x, of the convolution, and of out_proj's inputs."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                 parallel: ParallelState = SINGLE) -> None:
        super().__init__()
        kw = dict(dtype=dtype, device=device, bias=cfg.linear.conv_bias)
        hidden = cfg.hidden_size
        channels = split_evenly(hidden, parallel.tp_rank, parallel.tp_size)
        self.in_proj = ColumnParallelLinear(hidden, (channels,) * 3, **kw)
        self.conv = column_weight(channels, 1, cfg.linear.conv_kernel, **kw)
        self.out_proj = RowParallelLinear(channels, hidden, state=parallel, **kw)

    def state_shapes(self):
        return (self.conv.weight.shape[0], self.conv.weight.shape[-1] - 1), None

    def weight_targets(self, prefix: str) -> dict[str, torch.Tensor]:
        return linear_targets(prefix + "conv.", {name: (layer.part(), layer.bias_part()) for name, layer in (
            ("in_proj", self.in_proj), ("conv", self.conv), ("out_proj", self.out_proj))})

    def forward(self, x: torch.Tensor, states: LinearStateBatch) -> torch.Tensor:
        self.begin_step(states)
        b, c, h = self.in_proj(x).chunk(3, dim=-1)
        y = c * causal_conv(self.conv_state, b * h, self.conv.weight[:, 0], self.conv.bias, states, silu=False)
        snapshot_steps(self.pools(), states)  # the one-token sequences that completed a block
        return self.out_proj(y)
