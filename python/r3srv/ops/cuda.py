"""The CUDA backend: Triton kernels where the settings and the installed packages allow, torch
otherwise, each chosen once when a model is built (`build`). triton is imported only here, and
only when a model is built for CUDA (or a test binds this backend to CPU tensors under
TRITON_INTERPRET=1).

- paged decode attention: kernels/paged_decode_triton.py (`--[no-]triton-decode`);
- routing: the fused kernel (kernels/router_triton.py) for layers within its limits
  (`--force-torch-router`: the reference);
- the expert pass: two grouped GEMMs for bfloat16 (`--[no-]grouped-mm`), else a loop over
  the experts that received rows;
- a recurrent layer's decode step: the fused in-place steps of kernels/recurrent_triton.py
  (`--[no-]fused-step`);
- prefill attention: a step's whole prompts in one call to torch's varlen flash attention
  (kernels/prefill_varlen.py, `--varlen-prefill`: off until a GPU run checks it), SDPA per
  prompt otherwise;
- recurrent prefills of similar lengths are padded into groups and scanned together.
"""

from __future__ import annotations

import importlib.util

import torch

from r3srv.kernels import prefill_varlen
from r3srv.kernels.router_reference import route_reference
from r3srv.ops.attention import prefill_attention
from r3srv.ops.experts import Activation, TorchExperts, grouped_mm_available
from r3srv.ops.norm import REFERENCE_NORMS
from r3srv.ops.reference import no_fused_step
from r3srv.ops.rotary import ROTATIONS
from r3srv.ops.router import RouterShape
from r3srv.ops.table import Ops
from r3srv.settings import Settings

# A scan group pads its members to the longest: at most this many padded tokens per real one (a
# batch of rollouts' prompts is a few launches per layer, not a few per prompt)
SCAN_PAD_FACTOR = 2.0
# the fused recurrent steps by the name the layers ask for
RECURRENT_STEPS = {"delta_rule_step": "delta_rule_step_triton", "ssm_step": "ssm_step_triton"}


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def build(dtype: torch.dtype, current: Settings) -> Ops:
    triton = triton_available()
    decode = None
    if triton and current.triton_decode:
        from r3srv.kernels.paged_decode_triton import paged_decode_triton as decode
    fused_router = None
    if triton and not current.force_torch_router:
        from r3srv.kernels.router_triton import route_triton as fused_router

    def routers(shape: RouterShape):
        return fused_router if fused_router is not None and shape.fits_fused_kernel else route_reference

    grouped = current.grouped_mm and grouped_mm_available()

    def experts(activation: Activation):
        return TorchExperts(activation, grouped="cuda" if grouped else None)

    steps = None
    if triton and current.fused_step:
        from r3srv.kernels import recurrent_triton as steps

    def recurrent_steps(name: str):
        return None if steps is None else getattr(steps, RECURRENT_STEPS[name])

    prefill = prefill_attention
    if current.varlen_prefill and prefill_varlen.available():
        prefill = prefill_varlen.varlen_prefill(prefill_attention)

    return Ops(
        name="cuda", linear=torch.nn.functional.linear, norms=REFERENCE_NORMS, rotations=ROTATIONS,
        attention_heads=None, decode_attention=decode, prefill_attention=prefill, routers=routers,
        expert_passes=experts,
        recurrent_steps=recurrent_steps if steps is not None else no_fused_step, scan_pad_factor=SCAN_PAD_FACTOR,
    )
