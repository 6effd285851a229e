"""A vision-language checkpoint's image preprocessing, as its preprocessor_config.json says:
resize to a patch-aligned size within the pixel bounds (PIL bicubic), rescale, normalize,
and cut into the flat patches the vision tower reads, exactly as transformers' PIL image
processors (Qwen2VLImageProcessorPil for Qwen3-VL and Qwen3.5, Glm4vImageProcessorPil for
GLM-4.5V) do; tests/test_vision_processor.py holds them side by side."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from r3srv.errors import ConfigError, InvalidRequestError

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

# image_processor_type -> (resize rule, transformers' class defaults where the file is silent)
_DEFAULTS = {
    "qwen2_vl": dict(patch_size=14, temporal_patch_size=2, merge_size=2, min_pixels=56 * 56, max_pixels=28 * 28 * 1280),
    "glm4v": dict(patch_size=14, temporal_patch_size=2, merge_size=2, min_pixels=112 * 112,
                  max_pixels=28 * 28 * 15000),
}
_RULES = {"Qwen2VLImageProcessor": "qwen2_vl", "Qwen2VLImageProcessorFast": "qwen2_vl",
          "Qwen2VLImageProcessorPil": "qwen2_vl", "Glm4vImageProcessor": "glm4v", "Glm4vImageProcessorFast": "glm4v",
          "Glm4vImageProcessorPil": "glm4v"}
MAX_ASPECT_RATIO = 200  # both processors refuse longer sides than this many times the shorter


@dataclass(frozen=True)
class ImageProcessorConfig:
    rule: str  # "qwen2_vl" or "glm4v": how the target size is chosen (smart_resize's variants)
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    rescale_factor: float = 1 / 255
    resample: int = Image.Resampling.BICUBIC
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True

    @property
    def factor(self) -> int:
        """Sides are multiples of this: one merged token covers factor x factor pixels."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ImageProcessorConfig:
        kind = raw.get("image_processor_type")
        rule = _RULES.get(kind)
        if rule is None:
            raise ConfigError(f"preprocessor_config.json: image_processor_type {kind!r} is not supported "
                              f"(supported: {', '.join(sorted(_RULES))})")
        if raw.get("do_convert_rgb") is False:
            raise ConfigError("preprocessor_config.json: do_convert_rgb false is not supported")
        values = dict(_DEFAULTS[rule])
        size = raw.get("size") or {}
        # transformers: size's shortest/longest_edge are pixel counts; top-level min/max_pixels win
        for key, names in (("min_pixels", ("shortest_edge", "min_pixels")), ("max_pixels", ("longest_edge", "max_pixels"))):
            for name in names:
                if size.get(name) is not None:
                    values[key] = int(size[name])
            if raw.get(key) is not None:
                values[key] = int(raw[key])
        for key in ("patch_size", "temporal_patch_size", "merge_size"):
            if raw.get(key) is not None:
                values[key] = int(raw[key])
        extra = {key: tuple(float(v) for v in raw[key]) for key in ("image_mean", "image_std") if raw.get(key) is not None}
        for key in ("do_resize", "do_rescale", "do_normalize"):
            if raw.get(key) is not None:
                extra[key] = bool(raw[key])
        if raw.get("rescale_factor") is not None:
            extra["rescale_factor"] = float(raw["rescale_factor"])
        if raw.get("resample") is not None:
            extra["resample"] = int(raw["resample"])
        cfg = cls(rule=rule, **values, **extra)
        if min(cfg.patch_size, cfg.temporal_patch_size, cfg.merge_size) < 1 or not 0 < cfg.min_pixels <= cfg.max_pixels:
            raise ConfigError(f"preprocessor_config.json describes no usable preprocessing: {cfg}")
        if len(cfg.image_mean) != 3 or len(cfg.image_std) != 3:
            raise ConfigError("preprocessor_config.json: image_mean and image_std need one value per RGB channel")
        return cfg

    @classmethod
    def from_dir(cls, path: str | Path) -> ImageProcessorConfig:
        file = Path(path) / "preprocessor_config.json"
        try:
            return cls.from_dict(json.loads(file.read_text(encoding="utf-8")))
        except FileNotFoundError:
            raise ConfigError(f"{path} has no preprocessor_config.json: image inputs need it") from None
        except (OSError, ValueError, TypeError) as exc:
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError(f"cannot read {file}: {exc}") from exc


@dataclass(frozen=True)
class ProcessedImage:
    pixel_values: np.ndarray  # (grid_h * grid_w, 3 * temporal_patch_size * patch_size**2) float32
    grid_thw: tuple[int, int, int]  # (1, grid_h, grid_w) patches

    def num_tokens(self, merge_size: int) -> int:
        """Placeholder tokens the image takes in the prompt: one per merge_size x merge_size patches."""
        t, h, w = self.grid_thw
        return t * h * w // (merge_size * merge_size)


def target_size(cfg: ImageProcessorConfig, height: int, width: int, *, param: str) -> tuple[int, int]:
    """The patch-aligned (height, width) the image is resized to (transformers' smart_resize)."""
    factor = cfg.factor
    if cfg.rule == "glm4v" and (height < factor or width < factor):  # GLM scales tiny images up first
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise InvalidRequestError(param=param, problem=f" is {width}x{height} pixels: the longer side may be at most "
                                  f"{MAX_ASPECT_RATIO} times the shorter")
    frames = cfg.temporal_patch_size if cfg.rule == "glm4v" else 1  # GLM counts an image as its frames
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if frames * h_bar * w_bar > cfg.max_pixels:
        beta = math.sqrt(frames * height * width / cfg.max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif frames * h_bar * w_bar < cfg.min_pixels:
        beta = math.sqrt(cfg.min_pixels / (frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def preprocess(cfg: ImageProcessorConfig, image: np.ndarray, *, param: str) -> ProcessedImage:
    """An (H, W, 3) uint8 image as the vision tower's flat patches and grid."""
    height, width = image.shape[:2]
    if cfg.do_resize:
        height, width = target_size(cfg, height, width, param=param)
        image = np.array(Image.fromarray(image).resize((width, height), resample=cfg.resample))
    elif height % cfg.factor or width % cfg.factor:
        raise InvalidRequestError(param=param, problem=f" is {width}x{height} pixels: without resizing both sides "
                                  f"must be multiples of {cfg.factor}")
    pixels = image.transpose(2, 0, 1)  # channels first, as the processors work
    if cfg.do_rescale:  # in float64, then float32 (transformers' rescale)
        pixels = (pixels.astype(np.float64) * cfg.rescale_factor).astype(np.float32)
    else:
        pixels = pixels.astype(np.float32)
    if cfg.do_normalize:
        mean = np.array(cfg.image_mean, dtype=np.float32)[:, None, None]
        std = np.array(cfg.image_std, dtype=np.float32)[:, None, None]
        pixels = (pixels - mean) / std
    return ProcessedImage(patchify(cfg, pixels), (1, height // cfg.patch_size, width // cfg.patch_size))


def patchify(cfg: ImageProcessorConfig, pixels: np.ndarray) -> np.ndarray:
    """(3, H, W) -> (grid_h * grid_w, 3 * T * P * P): patches in merge-block order (each block's
    merge_size**2 patches together, row by row), each repeated over the temporal patch."""
    p, m, t = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    channels, height, width = pixels.shape
    gh, gw = height // p, width // p
    blocks = pixels.reshape(channels, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
    frames = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], t, p, p))
    return np.ascontiguousarray(frames.reshape(gh * gw, channels * t * p * p), dtype=np.float32)
