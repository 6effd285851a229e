"""The reference backend: torch everywhere (any device), the test oracle of the others and what
layers built outside a model use until the model binds its own backend."""

from __future__ import annotations

import torch.nn.functional as F

from r3srv.ops.attention import prefill_attention
from r3srv.ops.experts import Activation, TorchExperts
from r3srv.ops.norm import REFERENCE_NORMS
from r3srv.ops.rotary import ROTATIONS
from r3srv.ops.router import reference_router
from r3srv.ops.table import Ops


def torch_experts(activation: Activation) -> TorchExperts:
    return TorchExperts(activation)


def no_fused_step(name: str) -> None:
    return None


REFERENCE = Ops(
    name="reference", linear=F.linear, norms=REFERENCE_NORMS, rotations=ROTATIONS, attention_heads=None,
    decode_attention=None, prefill_attention=prefill_attention, routers=reference_router, expert_passes=torch_experts, recurrent_steps=no_fused_step,
    scan_pad_factor=0.0,
)
