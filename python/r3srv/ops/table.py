"""`Ops`: the kernels one model runs, each op resolved once for the model's device, dtype and
settings when the model is built (ops/__init__.py's `ops_for`), then held by its layers.

A backend module (ops/reference.py, ops/cpu.py, ops/cuda.py) builds one; adding a kernel for
an op on a device changes that device's module alone. The layers call what they hold and never
ask which device they run on; a call may still decline its kernel for what only the call
knows (more rows than a kernel takes, a capture view it cannot write), with the op's torch
path then.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from r3srv.ops.attention import DecodeKernel, PrefillKernel
from r3srv.ops.experts import Activation, ExpertPass, shared_expert_gate
from r3srv.ops.linear import LinearFn
from r3srv.ops.norm import NormFn
from r3srv.ops.rotary import RotateFn
from r3srv.ops.router import RouterChoice, RouteFn, RouterShape


@dataclass(frozen=True)
class Ops:
    name: str  # the backend: "reference", "cpu" or "cuda"
    linear: LinearFn  # F.linear's contract
    norms: Mapping[str, NormFn]  # by ops/norm.py's NORM_KINDS
    rotations: Mapping[str, RotateFn]  # by layout: "half", "interleaved"
    # an attention layer's split of q/k/v, per-head q/k norms and half-split RoPE in one call
    # (kernels/qk_rope_cpu.py's qk_norm_rope signature; None where it declines the call), or None
    attention_heads: Callable[..., Any] | None
    decode_attention: DecodeKernel | None  # the paged decode kernel (None: gather + SDPA)
    prefill_attention: PrefillKernel  # a step's prompts' attention, in one call
    routers: RouterChoice  # a MoE layer's route function, by its RouterShape
    expert_passes: Callable[[Activation], ExpertPass]  # a MoE layer's expert pass, by its activation
    recurrent_steps: Callable[[str], Callable[..., Any] | None]  # a fused in-place recurrent step by name, or None
    scan_pad_factor: float  # recurrent prefills: padded tokens per real one a scan group may take
    # the fused decode step of a decoder layer ((ops/parts.py's DecoderParts, this table's linear,
    # which the layer's adapter slots take) -> a step, or Declined), and the per-step plan its
    # steps share; None: the layers' own modules
    fuse_decoder_layer: Callable[..., Any] | None = None
    plan_fused_step: Callable[..., Any] | None = None
    threads: int = 1  # the CPU kernels' threads
    torch_threads: Callable[[int], int] | None = None  # torch's threads for a step of so many tokens
    # a shared expert's gate, sigmoid(x @ w^T) [T, 1] (Qwen2-MoE's shared_expert_gate)
    shared_gate: Callable[..., Any] = shared_expert_gate
    # every op computes a token's row alike in any step (ops/invariant.py): layers with a path of
    # their own for prompts (MLA's expanded keys) take their decodes' path for every token
    batch_invariant: bool = False

    def norm(self, kind: str) -> NormFn:
        return self.norms[kind]

    def rotate(self, layout: str) -> RotateFn:
        return self.rotations[layout]

    def router(self, shape: RouterShape) -> RouteFn:
        return self.routers(shape)

    def experts(self, activation: Activation) -> ExpertPass:
        return self.expert_passes(activation)

    def recurrent_step(self, name: str):
        return self.recurrent_steps(name)

    def replace(self, **changes) -> Ops:
        """These ops with some replaced (tests: a kernel forced onto another device's tensors)."""
        return replace(self, **changes)
