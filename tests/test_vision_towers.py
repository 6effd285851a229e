"""The vision towers (r3srv/models/vision) against transformers' own vision models, on tiny
random checkpoints: one, two and three images of several sizes and aspect ratios through each
tower in one call; the merged embeddings (and Qwen3-VL's deepstack features) match."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from r3srv.errors import ConfigError
from r3srv.models.vision import load_vision_tower
from r3srv.vision.decode import decode_image
from r3srv.vision.processor import ImageProcessorConfig, preprocess
from vision_testing import FAMILIES, IMAGE_CASES, glm4v_moe, image_bytes, write_vision_checkpoint

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow  # transformers oracles

@pytest.fixture(scope="module", params=list(FAMILIES))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf, _ = write_vision_checkpoint(transformers, request.param, path, seed=5)
    return path, hf, ImageProcessorConfig.from_dir(path)


def pixels_of(cfg, cases):
    images = [preprocess(cfg, decode_image(image_bytes(w, h, m, f, seed=s), param="image", max_pixels=1 << 20),
                         param="image") for s, (w, h, m, f) in cases]
    return torch.from_numpy(np.concatenate([i.pixel_values for i in images])), [i.grid_thw for i in images]


@pytest.mark.parametrize("cases", [[0], [1, 4], [2, 3, 6]], ids=["one", "two", "three"])
def test_tower_matches_transformers_vision_model(checkpoint, cases):
    path, hf, cfg = checkpoint
    tower = load_vision_tower(path)
    pixels, grids = pixels_of(cfg, [(i, IMAGE_CASES[i]) for i in cases])
    with torch.no_grad():
        want = hf.model.visual(pixels, grid_thw=torch.tensor(grids), return_dict=True)
    got = tower(pixels, grids)
    tokens = sum(t * h * w for t, h, w in grids) // tower.merge_size ** 2
    assert got.embeds.shape == (tokens, hf.config.text_config.hidden_size)
    torch.testing.assert_close(got.embeds, want.pooler_output, rtol=1e-4, atol=1e-4)
    want_deepstack = getattr(want, "deepstack_features", None) or []
    assert len(got.deepstack) == len(want_deepstack) == len(hf.config.vision_config.to_dict().get(
        "deepstack_visual_indexes", []))
    for ours, theirs in zip(got.deepstack, want_deepstack):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_an_image_embeds_alike_alone_and_beside_others(checkpoint):
    """Attention stays within an image: its embeddings do not depend on the other images of the call."""
    path, _, cfg = checkpoint
    tower = load_vision_tower(path)
    pixels, grids = pixels_of(cfg, [(2, IMAGE_CASES[2]), (5, IMAGE_CASES[5])])
    both = tower(pixels, grids).embeds
    alone = tower(*pixels_of(cfg, [(5, IMAGE_CASES[5])])).embeds
    torch.testing.assert_close(both[-alone.shape[0]:], alone, rtol=1e-5, atol=1e-5)


def test_missing_or_misshapen_tower_weights_are_config_errors(tmp_path):
    from safetensors.torch import load_file, save_file

    hf, _ = glm4v_moe(transformers)
    hf.save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if "downsample" not in k}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ConfigError, match="lacks vision-tower weights"):
        load_vision_tower(tmp_path)
    tensors["model.visual.downsample.weight"] = tensors["model.visual.downsample.weight"][:, :, :1].contiguous()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ConfigError, match="has shape"):
        load_vision_tower(tmp_path)
