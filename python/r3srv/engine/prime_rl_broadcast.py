"""prime-rl's NCCL weight broadcast, the receiving side (prime-rl's `NCCLWeightUpdateWorker`).

The trainer is rank 0 of vLLM's StatelessProcessGroup rendezvous (engine/vllm_transfer.py); each
inference rank joins as rank_offset + its rank + 1 of inference_world_size + 1. A push sends, from
rank 0: the number of state dicts (an int64), then per state dict its metadata's size (an int64),
the metadata (a pickle of {torch dtype: [(name, torch.Size, numel), ...]}, as uint8), and one
concatenated tensor per dtype, in the metadata's order.

The names come in-band, so each state dict's names and shapes are checked (`check`) before its
tensors are received. The metadata pickle is read with an unpickler that resolves torch.Size and
torch dtypes only: any other global is refused before anything is called.
"""

from __future__ import annotations

import io
import math
import pickle
from collections.abc import Callable

import torch

from r3srv.engine.process_groups import broadcast_from_trainer

MAX_STATE_DICTS = 1 << 20
MAX_METADATA_BYTES = 64 << 20

Metadata = list[tuple[torch.dtype, list[tuple[str, tuple[int, ...], int]]]]


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module == "torch" and name == "Size":
            return torch.Size
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not torch.Size or a torch dtype")

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("persistent ids are not allowed")


def read_metadata(data: bytes) -> Metadata:
    """prime-rl's metadata, checked: a dict of dtype -> list of (name, shape, numel) whose numel
    is the shape's product; a ValueError for anything else."""
    try:
        value = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as exc:  # whatever a malformed or hostile pickle raises; nothing else ran
        raise ValueError(f"not prime-rl's state-dict metadata: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"not prime-rl's state-dict metadata: a {type(value).__name__}, not a dict")
    metadata: Metadata = []
    for dtype, items in value.items():
        if not isinstance(dtype, torch.dtype) or not isinstance(items, list):
            raise ValueError("not prime-rl's state-dict metadata: keys are dtypes, values lists")
        entries = []
        for item in items:
            ok = (isinstance(item, tuple) and len(item) == 3 and isinstance(item[0], str)
                  and isinstance(item[1], (tuple, list)) and all(type(d) is int and d >= 0 for d in item[1])
                  and type(item[2]) is int and item[2] == math.prod(item[1]))
            if not ok:
                raise ValueError(f"not prime-rl's state-dict metadata: entry {item!r:.200}")
            entries.append((item[0], tuple(item[1]), item[2]))
        metadata.append((dtype, entries))
    return metadata


def _receive_integer(group, device: torch.device) -> int:
    value = torch.zeros(1, dtype=torch.long, device=device)
    broadcast_from_trainer(group, [value])
    return int(value.item())


def receive_state_dicts(group, device: torch.device,
                        check: Callable[[dict[str, tuple[tuple[int, ...], torch.dtype]]], None],
                        on_tensor: Callable[[int], None] | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of one prime-rl push (blocking). `check` sees each state dict's names, shapes
    and dtypes before its tensors arrive, and raises to refuse them."""
    count = _receive_integer(group, device)
    if not 0 <= count <= MAX_STATE_DICTS:
        raise ValueError(f"the trainer announced {count} state dicts")
    received: dict[str, torch.Tensor] = {}
    for _ in range(count):
        size = _receive_integer(group, device)
        if not 0 < size <= MAX_METADATA_BYTES:
            raise ValueError(f"the trainer announced {size} bytes of metadata")
        raw = torch.empty(size, dtype=torch.uint8, device=device)
        broadcast_from_trainer(group, [raw])
        metadata = read_metadata(raw.cpu().numpy().tobytes())
        check({name: (shape, dtype) for dtype, items in metadata for name, shape, _ in items})
        for dtype, items in metadata:
            joined = torch.empty(sum(numel for _, _, numel in items), dtype=dtype, device=device)
            broadcast_from_trainer(group, [joined])
            for (name, shape, _), part in zip(items, joined.split([numel for _, _, numel in items])):
                if name in received:
                    raise ValueError(f"the trainer sent {name} twice")
                received[name] = part.view(shape)
            if on_tensor is not None:
                on_tensor(len(received))
    return received
