"""What a layer hands a backend's fused op: its own parameters and switches, described by the
layer itself (`parts()` of models/model.py's layers), never read out of its internals.

Every field that adds something to the plain computation has a default that means "nothing
added" (no bias, no window, a multiplier of 1). A fused op names the fields it computes and
calls `unsupported` for the rest: any field left at a value other than its default makes it
decline, naming the field. So a part a layer gains (an adapter on a projection, another norm)
either reaches the fused op, which must then compute it, or makes it decline at build time; it
is never skipped silently.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from r3srv.ops.experts import Activation


class Declined(Exception):
    """A fused op cannot compute what it was handed; the message names the parts."""


@dataclass(frozen=True)
class LinearParts:
    weight: torch.Tensor
    bias: torch.Tensor | None = None
    lora: Any = None  # adapter slots (r3srv.lora.slots): a low-rank term per token's adapter


@dataclass(frozen=True)
class NormParts:
    weight: torch.Tensor
    eps: float
    kind: str = "default"  # ops/norm.py's NORM_KINDS


@dataclass(frozen=True)
class AttentionParts:
    """Grouped-query attention: q/k/v projected together, per-head norms, RoPE, paged cache."""

    layer: Any  # holds the cache (k_cache, v_cache), allocated after the model is built
    qkv: LinearParts
    o: LinearParts
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    rope: bool  # rotated (by the half-split layout unless rope_layout says otherwise)
    q_norm: NormParts | None = None  # per head
    k_norm: NormParts | None = None
    rope_layout: str = "half"
    norm_over_heads: bool = False  # q/k normed over every head rather than per head
    output_gate: bool = False  # q_proj's rows hold a gate per head
    gate: LinearParts | None = None  # a separate projection's sigmoid gate
    clip_qkv: float | None = None
    window: int | None = None
    sinks: torch.Tensor | None = None
    tp_size: int = 1


@dataclass(frozen=True)
class RouterParts:
    gate: LinearParts
    top_k: int
    scoring: str
    renormalize: bool
    scaling: float
    correction_bias: torch.Tensor | None = None
    num_groups: int = 1
    topk_groups: int = 1


@dataclass(frozen=True)
class ExpertParts:
    w13: torch.Tensor
    w2: torch.Tensor
    activation: Activation
    b13: torch.Tensor | None = None
    b2: torch.Tensor | None = None
    ep_size: int = 1
    tp_size: int = 1
    lora: Any = None  # adapter slots (r3srv.lora.slots.LoraExperts)


@dataclass(frozen=True)
class MlpParts:
    gate_up: LinearParts
    down: LinearParts
    activation: Activation
    tp_size: int = 1


@dataclass(frozen=True)
class MoeParts:
    router: RouterParts
    experts: ExpertParts
    shared: MlpParts | None = None
    shared_gate: torch.Tensor | None = None


@dataclass(frozen=True)
class DecoderParts:
    """A decoder layer: a token mixer, then an MLP, each behind its norm and residual add. A
    mixer or MLP without parts of its own is named by its class."""

    mixer: AttentionParts | str
    mlp: MoeParts | MlpParts | str
    input_norm: NormParts | None = None
    post_attention_norm: NormParts | None = None
    attn_out_norm: NormParts | None = None
    mlp_out_norm: NormParts | None = None
    residual_multiplier: float = 1.0


def unsupported(parts: Any, handled: set[str], prefix: str = "") -> list[str]:
    """`prefix` + the fields of `parts` outside `handled` whose value is not their default (a
    field without a default is never neutral)."""
    names = []
    for f in dataclasses.fields(parts):
        if f.name in handled:
            continue
        value = getattr(parts, f.name)
        if f.default is dataclasses.MISSING or not _is_default(value, f.default):
            names.append(prefix + f.name)
    return names


def _is_default(value: Any, default: Any) -> bool:
    if value is default:
        return True
    return not isinstance(value, torch.Tensor) and not isinstance(default, torch.Tensor) and value == default
