"""The typed pieces a family's config.json becomes (models/families/), which the shared layers read.

Each spec describes one concern with the defaults of a plain Llama-style MoE decoder; a family
module departs from them where its checkpoint does. The layers switch on these fields, never on
a family's name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class NormSpec:
    eps: float = 1e-6
    zero_centered: bool = False  # weights stored as w - 1 (scaled by 1 + w, in float32): Qwen3-Next, Qwen3.5
    weight_float32: bool = False  # scaled by the weight in float32, cast back last
    pre: bool = True  # a norm before each branch (False: OLMo-2's layout, output norms only)
    sandwich: bool = False  # a norm on each branch's output too, before the residual add


@dataclass(frozen=True)
class RopeSpec:
    theta: float = 10000.0
    linear_factor: float = 1.0  # "linear" scaling divides positions by this
    # YaRN (rope_type "yarn"): factor, original_max_position_embeddings, beta_fast, beta_slow,
    # mscale, mscale_all_dim, attention_factor, truncate, as in config.json
    yarn: dict[str, Any] | None = None
    partial_factor: float = 1.0  # rotate the first head_dim * this dims
    interleave: bool = False  # pairs (x0, x1), (x2, x3), ... (DeepSeek) instead of halves
    enabled: bool = True  # False: attention without positions
    layers: list[int] | None = None  # rotate in these layers only (None: all)
    # M-RoPE (vision-language models): the rotary frequencies split among the temporal, height
    # and width position ids by these counts, taking turns (Qwen3-VL, Qwen3.5: interleaved) or
    # in three runs (GLM-4.5V); a token whose three ids are equal (text) rotates as plain RoPE
    mrope_section: tuple[int, int, int] | None = None
    mrope_interleaved: bool = False


@dataclass(frozen=True)
class MlaSpec:
    """Multi-head latent attention (models/mla.py): K/V cached as one latent of kv_lora_rank +
    the rotary width per token; the model's head_dim is then the rotary width."""

    kv_lora_rank: int
    q_lora_rank: int  # > 0: q through a low-rank pair (q_a_proj, q_a_layernorm, q_b_proj)
    qk_nope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class SparseIndexSpec:
    """DeepSeek Sparse Attention's indexer (models/dsa.py): each query attends to the `topk`
    keys it scores best; `shared_layers` reuse the last indexer's choice."""

    topk: int
    n_heads: int
    head_dim: int
    rope_interleave: bool = False
    shared_layers: list[int] = field(default_factory=list)

    def indexer_layers(self, num_layers: int) -> list[int]:
        """The layers with an indexer of their own, in order (the captured selections' layers)."""
        shared = set(self.shared_layers)
        return [i for i in range(num_layers) if i not in shared]

    def source_layers(self, num_layers: int) -> list[int]:
        """Per layer, the place among indexer_layers of the selection it attends with (a shared
        layer's is the last indexer before it)."""
        shared, source, n = set(self.shared_layers), [], -1
        for i in range(num_layers):
            n += i not in shared
            source.append(n)
        return source


@dataclass(frozen=True)
class AttentionSpec:
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: str | None = None  # "head": RMSNorm over head_dim; "full": over all heads
    clip_qkv: float | None = None
    sinks: bool = False  # a learned per-head logit in every softmax's denominator
    sliding_windows: list[int | None] | None = None  # per layer: keys within this many positions back
    scale: float | None = None  # None: 1 / sqrt(head_dim)
    output_gate: bool = False  # q_proj also yields a per-head sigmoid gate on the output
    gate_proj: bool = False  # a separate projection's sigmoid gates the output
    mla: MlaSpec | None = None
    sparse: SparseIndexSpec | None = None  # with mla only

    def window(self, layer: int) -> int | None:
        return self.sliding_windows[layer] if self.sliding_windows else None


@dataclass(frozen=True)
class RouterSpec:
    scoring: str = "softmax"  # or "sigmoid"
    renormalize: bool = True  # top-k weights renormalised to sum to one
    correction_bias: bool = False  # added to the scores for the choice only (float32)
    scaling: float = 1.0  # multiplies the routed experts' weights
    num_groups: int = 1  # > 1: group-limited routing
    topk_groups: int = 1
    group_score_top: int = 2  # a group scores the sum of its best this many
    float32: bool = False  # router matmul in float32 whatever the model dtype
    logit_bias: bool = False  # the router linear has a bias, part of the logits


@dataclass(frozen=True)
class ExpertSpec:
    # "silu": silu(gate) * up (w13: gate rows then up rows); "clamped_swiglu" (gpt-oss's): interleaved
    # gate/up rows, clamped at swiglu_limit, gate * sigmoid(swiglu_alpha * gate) * (up + 1), biases;
    # "relu2": relu(up)^2, non-gated (w13: up rows only; dense MLPs too)
    activation: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    shared_intermediate_size: int = 0  # > 0: a shared expert every token goes through
    shared_gate: bool = True  # the shared expert scaled by a sigmoid gate

    @property
    def gated(self) -> bool:
        return self.activation != "relu2"


@dataclass(frozen=True)
class ScaleSpec:
    """muP-style scalars: embeddings times `embedding`, each residual branch times `residual`,
    logits divided by `logits`."""

    embedding: float = 1.0
    residual: float = 1.0
    logits: float = 1.0


@dataclass(frozen=True)
class LinearAttentionSpec:
    """The layers holding a per-sequence state instead of K/V (models/recurrent.py), and their
    kind: "gated_deltanet" (models/gated_deltanet.py), "kda" (models/kda.py), "mamba2"
    (models/mamba2.py) or "short_conv" (models/short_conv.py)."""

    kind: str
    layers: list[int]
    conv_kernel: int = 4
    # Gated DeltaNet and KDA
    num_key_heads: int = 0
    num_value_heads: int = 0
    key_head_dim: int = 0
    value_head_dim: int = 0
    projection_layout: str = "qkvz_ba"  # Gated DeltaNet's in_proj rows: "qkvz_ba" or "qkv_z_b_a"
    # Mamba-2
    mamba_num_heads: int = 0
    mamba_head_dim: int = 0
    state_size: int = 0
    groups: int = 1
    proj_bias: bool = False
    dt_min: float = 0.0  # the step dt is clamped to at least this
    conv_bias: bool = False  # Mamba-2's convolution; the short convolution's every linear

    def state_bytes(self, hidden_size: int, dtype: torch.dtype) -> int:
        """One sequence's state in every such layer: the convolution's last kernel - 1 inputs
        (model dtype) and the float32 recurrent state."""
        if self.kind == "mamba2":  # head_dim x state_size per head
            conv = (self.mamba_num_heads * self.mamba_head_dim + 2 * self.groups * self.state_size) * (self.conv_kernel - 1)
            recurrent = self.mamba_num_heads * self.mamba_head_dim * self.state_size
        elif self.kind == "short_conv":  # the convolution's window alone
            conv, recurrent = hidden_size * (self.conv_kernel - 1), 0
        elif self.kind == "kda":  # q, k and v convolved; a dk x dv matrix per head
            heads, dim = self.num_value_heads, self.value_head_dim
            conv, recurrent = 3 * heads * dim * (self.conv_kernel - 1), heads * dim * dim
        else:  # Gated DeltaNet: a matrix per value head
            conv = (2 * self.num_key_heads * self.key_head_dim + self.num_value_heads * self.value_head_dim) * (
                self.conv_kernel - 1)
            recurrent = self.num_value_heads * self.key_head_dim * self.value_head_dim
        return len(self.layers) * (conv * dtype.itemsize + recurrent * 4)


@dataclass(frozen=True)
class VisionSpec:
    """A vision-language checkpoint's image inputs (models/vision/ has its tower): the token
    that stands for one merged block of patches in the prompt, and how many patches a side of
    such a block holds."""

    image_token_id: int
    merge_size: int
