"""Image preprocessing (r3srv/vision) against transformers' own PIL image processors, on
generated images of several sizes, aspect ratios, modes and formats: the same patches, bit for
bit, and the same grids; bad images are 400s naming the field."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from r3srv.errors import ConfigError, InvalidRequestError
from r3srv.vision.decode import decode_image
from r3srv.vision.processor import ImageProcessorConfig, preprocess, target_size
from vision_testing import IMAGE_CASES, image_bytes

transformers = pytest.importorskip("transformers")

# preprocessor_config.json as the checkpoints ship them (pixel bounds scaled down so the tests
# stay small, and one with transformers' class defaults); each names its processor class
CONFIGS = {
    "qwen3_vl": {"image_processor_type": "Qwen2VLImageProcessorFast", "patch_size": 16, "temporal_patch_size": 2,
                 "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
                 "size": {"shortest_edge": 4096, "longest_edge": 32768}},
    "qwen2_vl_defaults_old_keys": {"image_processor_type": "Qwen2VLImageProcessor", "min_pixels": 3136,
                                   "max_pixels": 12544},
    "glm4v": {"image_processor_type": "Glm4vImageProcessor", "patch_size": 14, "temporal_patch_size": 2,
              "merge_size": 2, "size": {"shortest_edge": 12544, "longest_edge": 100352}},
    "glm4v_defaults": {"image_processor_type": "Glm4vImageProcessor"},
}
ORACLES = {"qwen2_vl": "Qwen2VLImageProcessorPil", "glm4v": "Glm4vImageProcessorPil"}


def oracle(raw: dict):
    cfg = ImageProcessorConfig.from_dict(raw)
    kwargs = {k: v for k, v in raw.items() if k != "image_processor_type"}
    return cfg, getattr(transformers, ORACLES[cfg.rule])(**kwargs)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_patches_and_grids_equal_transformers_processor(config):
    cfg, processor = oracle(CONFIGS[config])
    for seed, (width, height, mode, fmt) in enumerate(IMAGE_CASES):
        data = image_bytes(width, height, mode, fmt, seed=seed)
        want = processor(images=[Image.open(io.BytesIO(data))], return_tensors="np")
        got = preprocess(cfg, decode_image(data, param="image", max_pixels=1 << 20), param="image")
        case = f"{width}x{height} {mode} {fmt}"
        assert [list(got.grid_thw)] == want["image_grid_thw"].tolist(), case
        assert got.pixel_values.dtype == np.float32 and np.array_equal(got.pixel_values, want["pixel_values"]), case
        t, h, w = got.grid_thw
        assert got.num_tokens(cfg.merge_size) * cfg.merge_size ** 2 == t * h * w and got.num_tokens(cfg.merge_size) >= 1


def test_several_images_concatenate_as_transformers_batches_them():
    cfg, processor = oracle(CONFIGS["qwen3_vl"])
    datas = [image_bytes(w, h, m, f, seed=s) for s, (w, h, m, f) in enumerate(IMAGE_CASES[:3])]
    want = processor(images=[Image.open(io.BytesIO(d)) for d in datas], return_tensors="np")
    got = [preprocess(cfg, decode_image(d, param="image", max_pixels=1 << 20), param="image") for d in datas]
    assert np.array_equal(np.concatenate([g.pixel_values for g in got]), want["pixel_values"])
    assert [list(g.grid_thw) for g in got] == want["image_grid_thw"].tolist()


def test_target_sizes_stay_within_the_pixel_bounds():
    """Every target is patch-aligned and, for images that are not extreme, within the bounds."""
    cfg = ImageProcessorConfig.from_dict(CONFIGS["qwen3_vl"])
    rng = np.random.default_rng(3)
    for height, width in rng.integers(8, 2000, size=(200, 2)).tolist():
        if max(height, width) / min(height, width) > 10:
            continue
        h, w = target_size(cfg, height, width, param="image")
        assert h % cfg.factor == 0 and w % cfg.factor == 0
        assert cfg.min_pixels <= h * w <= cfg.max_pixels, (height, width, h, w)


@pytest.mark.parametrize("data,match", [
    (b"", "is empty"),
    (b"not an image at all", "not an image"),
    (image_bytes(40, 40, "RGB", "PNG")[:60], "could not be decoded"),   # truncated
    (image_bytes(40, 40, "RGB", "JPEG")[:200], "could not be decoded"),
    (image_bytes(600, 600, "RGB", "PNG"), "more than the 250000"),     # over the pixel cap, refused from the header
])
def test_bad_images_are_400s_naming_the_field(data, match):
    with pytest.raises(InvalidRequestError, match=match) as info:
        decode_image(data, param="messages[0].content[1].image_url", max_pixels=250_000)
    assert info.value.param == "messages[0].content[1].image_url"


def test_an_extreme_aspect_ratio_is_a_400():
    cfg = ImageProcessorConfig.from_dict(CONFIGS["qwen3_vl"])
    image = decode_image(image_bytes(1000, 4, "RGB", "PNG"), param="image_data[2]", max_pixels=1 << 20)
    with pytest.raises(InvalidRequestError, match="200 times") as info:
        preprocess(cfg, image, param="image_data[2]")
    assert info.value.param == "image_data[2]"


def test_preprocessor_configs_r3srv_cannot_follow_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="not supported"):
        ImageProcessorConfig.from_dict({"image_processor_type": "SiglipImageProcessor"})
    with pytest.raises(ConfigError, match="no preprocessor_config.json"):
        ImageProcessorConfig.from_dir(tmp_path)
    with pytest.raises(ConfigError, match="no usable"):
        ImageProcessorConfig.from_dict({"image_processor_type": "Glm4vImageProcessor", "min_pixels": 10, "max_pixels": 5})
