"""Quantized checkpoints as released, dequantized at load (r3srv serves the model dtype: no
low-precision GEMMs, routing computed from exactly the dequantized weights).

Block FP8 (MiniMax-M2, DeepSeek-V3, Qwen3-*-FP8): a linear weight `X.weight` is float8 (e4m3)
with one float32 scale per `weight_block_size` tile in `X.weight_scale_inv`: weight[i, j] =
fp8[i, j] * scale_inv[i // block_rows, j // block_cols] (DeepSeek-V3's `weight_dequant`).

MXFP4 (gpt-oss): `X_blocks` uint8 [..., rows, groups, 16] holds two FP4 (e2m1) values a byte,
low nibble first, 32 per group; `X_scales` uint8 [..., rows, groups] is each group's power-of-two
exponent biased by 127 (OCP Microscaling). The dequantized [..., rows, groups * 32] is the
transpose of transformers' parameter `X` (gpt-oss keeps experts as x @ W).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from r3srv.errors import ConfigError

SCALE_SUFFIX = "_scale_inv"  # X.weight -> X.weight_scale_inv
BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"  # MXFP4: X -> X_blocks, X_scales
# FP4 e2m1 code points 0..15: sign bit, two exponent bits, one mantissa bit
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
FP8_DTYPES = ("F8_E4M3",)  # safetensors' dtype names of the float8 formats we dequantize
E4M3_NAMES = ("e4m3", "float8_e4m3fn")  # quantization_config "fmt" spellings seen in releases


def parse_quantization(raw: dict[str, Any], architecture: str) -> tuple[tuple[int, int] | None, bool]:
    """(the FP8 weight block or None, whether MXFP4 tensors may appear) from config.json.

    Any other quantization is refused here, at start-up, rather than loaded as garbage.
    """
    quant = raw.get("quantization_config")
    if not quant:
        return None, False
    method = quant.get("quant_method")
    if method == "mxfp4":
        return None, True
    block = quant.get("weight_block_size")
    if method != "fp8" or quant.get("fmt", "e4m3") not in E4M3_NAMES or not block or len(block) != 2:
        raise ConfigError(
            f"{architecture}: quantization {method!r} (fmt={quant.get('fmt')!r}, weight_block_size={block!r}) is "
            "not supported; r3srv loads unquantized checkpoints, block-wise e4m3 FP8 ones (quant_method "
            "'fp8' with weight_block_size) and MXFP4 ones (quant_method 'mxfp4')"
        )
    rows, cols = (int(v) for v in block)
    if rows < 1 or cols < 1:
        raise ConfigError(f"{architecture}: weight_block_size {block} must be positive")
    return (rows, cols), False


def scale_shape(weight_shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    rows, cols = weight_shape
    return math.ceil(rows / block[0]), math.ceil(cols / block[1])


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
               origin: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """float32 weight of a [rows, cols] float8 tensor and its per-block scales. A slice of a
    larger weight starting at `origin` comes with the scale tiles from the one holding origin."""
    rows, cols = weight.shape
    r0, c0 = origin[0] % block[0], origin[1] % block[1]
    scale = scale_inv.float().repeat_interleave(block[0], dim=0)[r0 : r0 + rows]
    scale = scale.repeat_interleave(block[1], dim=1)[:, c0 : c0 + cols]
    return weight.float() * scale


def mxfp4_shape(blocks_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape transformers' parameter has once X_blocks is dequantized (last two dims swapped)."""
    *prefix, rows, groups, _ = blocks_shape
    return (*prefix, groups * 32, rows)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 [..., groups * 32, rows]: X_blocks and X_scales dequantized, laid out as
    transformers' parameter X (see the module docstring)."""
    if blocks.shape[-1] != 16 or tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise ConfigError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match")
    lut = torch.tensor(FP4_E2M1, dtype=torch.float32)
    codes = blocks.to(torch.int64)
    values = torch.stack((lut[codes & 0x0F], lut[codes >> 4]), dim=-1).flatten(-2)  # [..., rows, groups, 32]
    values = torch.ldexp(values, (scales.to(torch.int32) - 127)[..., None].float())
    return values.flatten(-2).transpose(-1, -2)
