"""Block-quantized FP8 checkpoints (MiniMax-M2's release, DeepSeek-V3, Qwen3-*-FP8), dequantized at load.

Such a checkpoint stores a linear weight `X.weight` as float8 (e4m3) with one float32 scale
per `weight_block_size` tile in `X.weight_scale_inv`: weight[i, j] = fp8[i, j] *
scale_inv[i // block_rows, j // block_cols] (DeepSeek-V3's `weight_dequant`). r3srv serves
the dequantized weights in the model dtype: no FP8 GEMMs, twice the checkpoint's memory in
bfloat16, and routing computed from exactly those weights.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from r3srv.errors import ConfigError

SCALE_SUFFIX = "_scale_inv"  # X.weight -> X.weight_scale_inv
FP8_DTYPES = ("F8_E4M3",)
E4M3_NAMES = ("e4m3", "float8_e4m3fn")  # quantization_config "fmt" spellings seen in releases  # safetensors' dtype names of the float8 formats we dequantize


def parse_fp8_block(raw: dict[str, Any], architecture: str) -> tuple[int, int] | None:
    """The (rows, cols) weight block of a block-FP8 checkpoint's config; None if unquantized.

    Any other quantization is refused here, at start-up, rather than loaded as garbage.
    """
    quant = raw.get("quantization_config")
    if not quant:
        return None
    method = quant.get("quant_method")
    block = quant.get("weight_block_size")
    if method != "fp8" or quant.get("fmt", "e4m3") not in E4M3_NAMES or not block or len(block) != 2:
        raise ConfigError(
            f"{architecture}: quantization {method!r} (fmt={quant.get('fmt')!r}, weight_block_size={block!r}) is "
            "not supported; r3srv loads unquantized checkpoints and block-wise e4m3 FP8 ones (quant_method "
            "'fp8' with weight_block_size)"
        )
    rows, cols = (int(v) for v in block)
    if rows < 1 or cols < 1:
        raise ConfigError(f"{architecture}: weight_block_size {block} must be positive")
    return rows, cols


def scale_shape(weight_shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    rows, cols = weight_shape
    return math.ceil(rows / block[0]), math.ceil(cols / block[1])


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """float32 weight of a [rows, cols] float8 tensor and its per-block scales."""
    rows, cols = weight.shape
    scale = scale_inv.float().repeat_interleave(block[0], dim=0)[:rows].repeat_interleave(block[1], dim=1)[:, :cols]
    return weight.float() * scale
