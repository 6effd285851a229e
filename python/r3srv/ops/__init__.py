"""The backend seam: every op a layer calls (norms, rotary, attention heads, paged decode
attention, the router, the expert pass, linear layers, recurrent steps, a fused decode layer),
its kernel chosen once per model for the model's device and dtype (`ops_for`, which reads the
settings then and never again). One module per op family (norm, rotary, linear, attention,
router, experts) holds the op's contract and its torch path; one module per backend
(reference, cpu, cuda) picks each op's kernel; `Ops` (table.py) is what a model's layers hold.
"""

from __future__ import annotations

import torch

from r3srv import settings
from r3srv.errors import ConfigError
from r3srv.ops.parts import Declined
from r3srv.ops.reference import REFERENCE
from r3srv.ops.table import Ops


def ops_for(device: torch.device | str, dtype: torch.dtype, *, batch_invariant: bool = False) -> Ops:
    """The ops a model on `device` in `dtype` runs, under the current settings; batch_invariant:
    the backend's batch-invariant ops (ops/invariant.py: the CPU's and CUDA's; ConfigError elsewhere)."""
    kind = torch.device(device).type
    current = settings.current()
    if batch_invariant and kind not in ("cpu", "cuda"):
        raise ConfigError(f"--batch-invariant has no kernels for {kind} (the CPU's and CUDA's only)")
    if kind == "cpu":
        from r3srv.ops import cpu, invariant

        base = cpu.build(dtype, current)
        return invariant.build(base, current.packed_experts, current.packed_linear) if batch_invariant else base
    if kind == "cuda":
        from r3srv.ops import cuda, invariant

        base = cuda.build(dtype, current)
        return invariant.build_cuda(base) if batch_invariant else base
    return REFERENCE


__all__ = ["REFERENCE", "Declined", "Ops", "ops_for"]
