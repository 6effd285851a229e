"""Small building blocks shared by every family's layers (the ops they call: r3srv.ops)."""

from __future__ import annotations

import torch


def empty_param(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.nn.Parameter:
    """An uninitialised, frozen parameter (the loader fills it)."""
    return torch.nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)
