"""Host numbers to the device without waiting for it.

On CUDA a copy from pageable host memory blocks the host until the GPU has run everything
queued before it: a decode step on an H200 made eight such copies (its inputs, the decode
kernel's arguments), each a wait in a step bound by the host. From pinned memory the copy is
queued like a kernel. Several arrays travel in one pinned block and one copy; torch's caching
host allocator keeps that block until its copy has run, so a later step never overwrites
data still in flight.
"""

from __future__ import annotations

import numpy as np
import torch


def to_device(arrays: list[np.ndarray | list], device: torch.device, dtype: type = np.int64) -> list[torch.Tensor]:
    """Tensors of `dtype` on `device` with the arrays' (or lists') shapes and values (on the
    CPU: the arrays themselves, as `dtype`, without a transfer)."""
    flat = [np.asarray(a, dtype=dtype) for a in arrays]
    if device.type != "cuda":
        return [torch.from_numpy(a) for a in flat]
    host = torch.from_numpy(np.concatenate([a.reshape(-1) for a in flat])).pin_memory()
    moved = host.to(device, non_blocking=True)
    return [part.view(a.shape) for part, a in zip(moved.split([a.size for a in flat]), flat)]
