"""Sparse MoE block: router -> route (captures ids) -> the expert pass.

A rank's experts (models/parallel.py's ExpertSlice) are stacked: w13 [E, 2I, H] (gate rows
then up rows), w2 [E, H, I]. The routing and the expert pass are the backend's ops, bound when
the model is built (r3srv.ops: ops/router.py, ops/experts.py): on the CPU one Rust call each
where it applies, torch's paths otherwise.
"""

from __future__ import annotations

import torch
from torch import nn

from r3srv.models.config import ModelConfig
from r3srv.models.layers import at_rows
from r3srv.models.parallel import SINGLE, ColumnParallelLinear, ExpertSlice, ParallelState, RowParallelLinear, split_evenly
from r3srv.ops import REFERENCE, Ops
from r3srv.ops.experts import RELU_SQUARED, SILU_AND_MUL, Activation
from r3srv.ops.parts import ExpertParts, LinearParts, MlpParts, MoeParts, RouterParts
from r3srv.ops.router import RouterShape


class Mlp(nn.Module):
    """down(act(gate_up(x))): a SwiGLU MLP (gate_up: gate rows then up rows) or Nemotron-H's
    non-gated relu^2 one (up rows alone), its intermediate size split over the tensor-parallel
    ranks (gate_up column-parallel, down row-parallel)."""

    def __init__(self, hidden: int, intermediate: int, *, gated: bool, parallel: ParallelState = SINGLE,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        piece = split_evenly(intermediate, parallel.tp_rank, parallel.tp_size)
        self.gated = gated
        self.activation = SILU_AND_MUL if gated else RELU_SQUARED
        self.tp_size = parallel.tp_size
        self.gate_up = ColumnParallelLinear(hidden, (piece,) * (2 if gated else 1), dtype=dtype, device=device)
        self.down = RowParallelLinear(piece, hidden, state=parallel, dtype=dtype, device=device)

    def parts(self) -> MlpParts:
        return MlpParts(self.gate_up.parts(), self.down.parts(), self.activation, self.tp_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.activation(self.gate_up(x)))


def expert_activation(cfg: ModelConfig) -> Activation:
    """The experts' activation the config asks for."""
    if cfg.experts.activation == "clamped_swiglu":
        return Activation("clamped_swiglu", cfg.experts.swiglu_alpha, cfg.experts.swiglu_limit)
    return SILU_AND_MUL if cfg.experts.gated else RELU_SQUARED


class SparseMoeBlock(nn.Module):
    """Routed experts, plus a shared expert when the config has one (Qwen2-MoE: sigmoid-gated;
    GLM-4.5: ungated). Experts are SwiGLU MLPs (w13 holds gate and up rows), gpt-oss's clamped
    variant, or Nemotron-H's non-gated relu^2 MLPs (w13 holds the up rows only)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                 parallel: ParallelState = SINGLE) -> None:
        super().__init__()
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        kw = dict(dtype=dtype, device=device)
        self.top_k = cfg.top_k
        self.renormalize = cfg.router.renormalize
        self.scoring = cfg.router.scoring
        self.scaling = cfg.router.scaling
        self.num_groups, self.topk_groups = cfg.router.num_groups, cfg.router.topk_groups
        self.group_score_top = cfg.router.group_score_top
        # A float32 router keeps the checkpoint's routing exact in a bf16 model: the reference
        # implementations compute these logits in float32, and the correction bias is stored
        # in float32 (rounding it to bf16 would change which experts win).
        router_dtype = torch.float32 if cfg.router.float32 else dtype
        self.gate = nn.Parameter(torch.empty(e, h, dtype=router_dtype, device=device), requires_grad=False)
        self.gate_bias = (
            nn.Parameter(torch.empty(e, dtype=router_dtype, device=device), requires_grad=False)
            if cfg.router.logit_bias else None
        )
        self.correction_bias = (
            nn.Parameter(torch.empty(e, dtype=torch.float32, device=device), requires_grad=False)
            if cfg.router.correction_bias else None
        )
        self.router_shape = RouterShape(e, self.top_k, self.num_groups, cfg.router.correction_bias)
        gpt_oss = cfg.experts.activation == "clamped_swiglu"  # biased experts, gate/up rows interleaved in w13
        self.experts = ExpertSlice(e, h, i, gated=cfg.experts.gated, interleaved=gpt_oss, biased=gpt_oss,
                                   state=parallel, **kw)
        self.activation = expert_activation(cfg)
        self.shared = self.shared_gate = None
        s = cfg.experts.shared_intermediate_size
        if s:
            self.shared = Mlp(h, s, gated=cfg.experts.gated, parallel=parallel, **kw)
            if cfg.experts.shared_gate:
                self.shared_gate = nn.Parameter(torch.empty(1, h, **kw), requires_grad=False)
        self.gate_lora = None  # the router gate's adapter slots (r3srv.lora) when served with LoRA
        self.use_ops(REFERENCE)

    def use_ops(self, ops: Ops) -> None:
        """The backend's linear, route function and expert pass for this block (r3srv.ops)."""
        self.ops = ops
        self.route = ops.router(self.router_shape)
        self.expert_pass = ops.experts(self.activation)

    def parts(self) -> MoeParts:
        experts = self.experts
        router = RouterParts(LinearParts(self.gate, self.gate_bias, self.gate_lora), self.top_k, self.scoring, self.renormalize,
                             self.scaling, self.correction_bias, self.num_groups, self.topk_groups)
        expert_parts = ExpertParts(experts.w13, experts.w2, self.activation, experts.b13, experts.b2,
                                   experts.state.ep_size, experts.state.tp_size, experts.lora)
        return MoeParts(router, expert_parts, None if self.shared is None else self.shared.parts(), self.shared_gate)

    def forward(self, x: torch.Tensor, capture: torch.Tensor | None, weights_capture: torch.Tensor | None = None,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """The block's output at `rows` of x (None: all rows); every row is routed (its ids and
        weights captured) whichever rows the experts then run for."""
        gate = self.gate
        gate_input = x if x.dtype == gate.dtype else x.to(gate.dtype)
        router_logits = self.ops.linear(gate_input, gate, self.gate_bias)
        if self.gate_lora is not None:  # an adapted router: the rows follow it
            router_logits = self.gate_lora(gate_input, router_logits, self.ops.linear, self.ops.threads)
        weights, ids = self.route(
            router_logits,
            self.top_k,
            scoring=self.scoring,
            renormalize=self.renormalize,
            correction_bias=self.correction_bias,
            scaling=self.scaling,
            capture=capture,
            num_groups=self.num_groups,
            topk_groups=self.topk_groups,
            group_score_top=self.group_score_top,
        )
        if weights_capture is not None:  # every route function returns the weights its ids get
            weights_capture.copy_(weights)
        x, weights, ids = at_rows(x, rows), at_rows(weights, rows), at_rows(ids, rows)
        expert_pass, lora = self.expert_pass, self.experts.lora
        if lora is not None and lora.active():  # this step's adapters on the experts (r3srv.lora.slots)
            expert_pass = lora.expert_pass(self.activation, self.ops.linear, self.ops.threads)
        out = self.experts(x, weights, ids, expert_pass)
        if self.shared is not None:
            shared = self.shared(x)
            out = out + (shared if self.shared_gate is None else self.ops.shared_gate(x, self.shared_gate) * shared)
        return out
