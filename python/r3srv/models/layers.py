"""Small building blocks shared by every family's layers (the ops they call: r3srv.ops)."""

from __future__ import annotations

import torch


def empty_param(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.nn.Parameter:
    """An uninitialised, frozen parameter (the loader fills it)."""
    return torch.nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


def at_rows(t: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """`t`'s rows `rows` (None: all of `t`): the rows of a step a layer's output is kept for."""
    return t if rows is None else t.index_select(0, rows)


def move_parameters(module: torch.nn.Module, device: torch.device | str) -> None:
    """Move every parameter of `module` to `device` in place (the module keeps its parameter
    objects; a tied one is moved once). From a GPU to the host into pinned memory, so that the
    way back is one fast copy (release_memory and resume_memory)."""
    device = torch.device(device)
    for param in module.parameters():
        pin = device.type == "cpu" and param.device.type == "cuda"
        data = param.data.to(device)
        param.data = data.pin_memory() if pin else data
