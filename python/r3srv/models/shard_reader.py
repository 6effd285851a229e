"""Read one rank's slice of a checkpoint tensor from safetensors, without reading the rest.

A target's splits (models/parallel.py) give, per split dim, the ranges this rank holds; each
combination of ranges is one `get_slice` read, and the blocks are concatenated back in order.
FP8 weights read the block scales covering their rows and columns; MXFP4 ones the packed
blocks and exponents of theirs. A whole target (size 1) reads the whole tensor as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from r3srv.errors import ConfigError
from r3srv.models import quantization as quant
from r3srv.models.parallel import Split

Ranges = dict[int, tuple[int, int]]  # dim -> [start, stop) in the checkpoint tensor's layout


def _assemble(splits: tuple[Split, ...], read: Callable[[Ranges], torch.Tensor], ranges: Ranges | None = None) -> torch.Tensor:
    ranges = {} if ranges is None else ranges
    if len(ranges) == len(splits):
        return read(ranges)
    split = splits[len(ranges)]
    blocks = [_assemble(splits, read, {**ranges, split.dim: r}) for r in split.ranges()]
    return blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=split.dim)


def _index(ndim: int, ranges: Ranges) -> tuple[slice, ...]:
    return tuple(slice(*ranges[d]) if d in ranges else slice(None) for d in range(ndim))


def read_tensor(f: Any, name: str, splits: tuple[Split, ...]) -> torch.Tensor:
    """`name`'s slice from an open safetensors file `f` (the whole tensor without splits)."""
    if not splits:
        return f.get_tensor(name)
    handle = f.get_slice(name)
    ndim = len(handle.get_shape())
    return _assemble(splits, lambda ranges: handle[_index(ndim, ranges)])


def read_fp8(f: Any, name: str, scales: Any, scale_name: str, block: tuple[int, int],
             splits: tuple[Split, ...]) -> torch.Tensor:
    """A block-FP8 weight's slice, dequantized with the scale tiles it overlaps."""
    if not splits:
        return quant.dequantize(f.get_tensor(name), scales.get_tensor(scale_name), block)
    weight, scale = f.get_slice(name), scales.get_slice(scale_name)
    shape = weight.get_shape()

    def read(ranges: Ranges) -> torch.Tensor:
        (r0, r1), (c0, c1) = (ranges.get(d, (0, shape[d])) for d in (0, 1))
        tiles = scale[r0 // block[0] : -(-r1 // block[0]), c0 // block[1] : -(-c1 // block[1])]
        return quant.dequantize(weight[r0:r1, c0:c1], tiles, block, origin=(r0, c0))

    return _assemble(splits, read)


def read_mxfp4(blocks: Any, blocks_name: str, scales: Any, scales_name: str, splits: tuple[Split, ...]) -> torch.Tensor:
    """An MXFP4 tensor's slice in transformers' layout [..., groups * 32, rows] (the splits'
    dims are that layout's): the packed rows and 32-value groups it covers, dequantized."""
    if not splits:
        return quant.dequantize_mxfp4(blocks.get_tensor(blocks_name), scales.get_tensor(scales_name))
    packed, exponents = blocks.get_slice(blocks_name), scales.get_slice(scales_name)
    ndim = len(packed.get_shape()) - 1  # the dequantized tensor's

    def read(ranges: Ranges) -> torch.Tensor:
        index = {d: r for d, r in ranges.items() if d < ndim - 2}
        if ndim - 1 in ranges:  # the dequantized last dim: the packed rows
            index[ndim - 2] = ranges[ndim - 1]
        if ndim - 2 in ranges:  # the dequantized rows: whole 32-value groups
            lo, hi = ranges[ndim - 2]
            if lo % 32 or hi % 32:
                raise ConfigError(f"{blocks_name}: a shard [{lo}, {hi}) cuts MXFP4's 32-value groups")
            index[ndim - 1] = (lo // 32, hi // 32)
        return quant.dequantize_mxfp4(packed[_index(ndim + 1, index)], exponents[_index(ndim, index)])

    return _assemble(splits, read)
