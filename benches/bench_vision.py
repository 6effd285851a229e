"""Time to first token of an image prompt against a text prompt of the same expanded length,
and the encoder cache's saving when a second turn sends the image again; same run.

    .venv/bin/python -m pytest benches/bench_vision.py

A tiny random Qwen3-VL-MoE checkpoint (tests/vision_testing.py) whose preprocessing lets a
160 x 160 image take 400 placeholder tokens; prefix caching off, so every run prefills the
whole prompt and only the encoder cache differs. benches/conftest.py prints reference / r3srv:
"image ttft" (reference: the text prompt; below 1.0x is what the image costs over its tokens)
and "second turn" (reference: the tower runs again; above 1.0x is the encoder cache's saving).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from r3srv import LLM, SamplingParams  # noqa: E402
from vision_testing import IMAGE_TOKEN, PREPROCESSOR, VISION_END, VISION_START, image_bytes, write_vision_checkpoint  # noqa: E402

transformers = pytest.importorskip("transformers")

SIDE = 160  # pixels: 400 merged tokens of 8 x 8 pixels (patch 4, merge 2)
FIRST = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_vl_moe")
    write_vision_checkpoint(transformers, "qwen3_vl_moe", path)
    bounds = {**PREPROCESSOR, "image_processor_type": "Qwen2VLImageProcessorFast",
              "size": {"shortest_edge": 256, "longest_edge": SIDE * SIDE}}
    (path / "preprocessor_config.json").write_text(json.dumps(bounds))
    llm = LLM(str(path), max_model_len=512, num_kv_blocks=64, enable_prefix_caching=False,
              max_num_batched_tokens=2048)
    image = image_bytes(SIDE, SIDE, "RGB", "PNG", seed=3)
    prompt = {"prompt_token_ids": [1, 2, 3, VISION_START, IMAGE_TOKEN, VISION_END, 4, 5],
              "multi_modal_data": {"image": image}}
    expanded = llm.generate(prompt, FIRST)[0].prompt_token_ids
    text = [(7 * i) % 200 for i in range(len(expanded))]
    return llm, prompt, text


def first_token(llm, prompt, cold: bool):
    if cold:
        llm.engine.runner.encoder.clear()
    return llm.generate(prompt, FIRST)


@pytest.mark.benchmark(group="image ttft")
@pytest.mark.parametrize("candidate", ["reference", "r3srv"])
def test_image_prompt_time_to_first_token(benchmark, engine, candidate):
    """reference: text of the image prompt's expanded length; r3srv: the image prompt, tower included."""
    llm, prompt, text = engine
    out = benchmark(first_token, llm, text if candidate == "reference" else prompt, cold=True)
    assert len(out[0].prompt_token_ids) == len(text)


@pytest.mark.benchmark(group="second turn")
@pytest.mark.parametrize("candidate", ["reference", "r3srv"])
def test_second_turn_encoder_cache(benchmark, engine, candidate):
    """reference: the tower encodes the image again; r3srv: its outputs come from the encoder cache."""
    llm, prompt, _ = engine
    encoder = llm.engine.runner.encoder
    first_token(llm, prompt, cold=False)
    encoded = encoder.images_encoded
    benchmark(first_token, llm, prompt, cold=candidate == "reference")
    assert (encoder.images_encoded > encoded) == (candidate == "reference")
