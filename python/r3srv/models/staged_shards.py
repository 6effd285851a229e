"""Pushed tensors cut down, on arrival, to what one rank's shard reads of them.

Under tensor parallelism every rank receives each tensor a trainer broadcasts in full, and
stages it until the update is complete. Staging the full tensors would hold a whole model per
rank; instead, once a call's tensors have arrived, this rank replays the loader's reads of them
(`planned_reads`: the same plan, splits, FP8 scale tiles and MXFP4 groups as a load from disk)
and keeps only the pieces those reads returned. At the update the loader reads them again,
through the same calls, and gets the same pieces back.
"""

from __future__ import annotations

import torch

from r3srv.models.loader import NamedTensors, plan_named_tensors, planned_reads


def _key(index) -> tuple:
    index = index if isinstance(index, tuple) else (index,)
    return tuple((i.start, i.stop, i.step) if isinstance(i, slice) else i for i in index)


class ShardPieces:
    """A tensor of full `shape` of which only the slices this rank reads are kept."""

    def __init__(self, shape: torch.Size, dtype: torch.dtype) -> None:
        self.shape, self.dtype = shape, dtype
        self.pieces: dict[tuple, torch.Tensor] = {}

    def __getitem__(self, index) -> torch.Tensor:
        try:
            return self.pieces[_key(index)]
        except KeyError:
            raise KeyError(f"a read of {_key(index)} that was not made when the tensor arrived") from None


class _Recorder(NamedTensors):
    """`named` read as the loader reads a shard, keeping what each read returned."""

    def __init__(self, named: NamedTensors) -> None:
        super().__init__(named.metas)
        self.full = named.tensors
        self.tensors = {}  # what is kept: whole tensors, or ShardPieces

    def get_tensor(self, name: str) -> torch.Tensor:
        self.tensors[name] = self.full[name]
        return self.full[name]

    def get_slice(self, name: str) -> "_RecordingSlice":
        pieces = self.tensors.setdefault(name, ShardPieces(self.full[name].shape, self.full[name].dtype))
        return _RecordingSlice(self.full[name], pieces)


class _RecordingSlice:
    def __init__(self, tensor: torch.Tensor, pieces: ShardPieces) -> None:
        self.tensor, self.pieces = tensor, pieces

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, index) -> torch.Tensor:
        piece = self.tensor[index].clone()  # its own storage: the full tensor can go
        self.pieces.pieces[_key(index)] = piece
        return piece


def keep_shard_pieces(model, named: NamedTensors) -> dict[str, torch.Tensor | ShardPieces]:
    """`named`'s tensors (all arrived) as this rank of `model` will read them at the update: a
    tensor read whole stays whole, one read in slices keeps only those slices. A tensor this
    rank never reads (another rank's experts) is not kept."""
    recorder = _Recorder(named)
    for _ in planned_reads(model, plan_named_tensors(model, named, complete=False), lambda shard: recorder):
        pass
    return recorder.tensors
