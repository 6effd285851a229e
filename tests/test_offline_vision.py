"""Images through the offline APIs, as vLLM's offline API takes them: `LLM.chat` with image_url
(data: URI) and image_pil content parts, r3srv.compat.vllm's `LLM.generate` with a text prompt
and `multi_modal_data` PIL images, its `LLM.chat`, and its AsyncLLM. The oracle is transformers'
image-text model on a tiny random checkpoint (the prompt its own tokenizer's chat template
renders, expanded by its own processor's grids; greedy tokens, logprobs, every position's
routed experts); parts r3srv does not take (video, pre-computed embeddings, URLs offline) are
400s naming the part."""

from __future__ import annotations

import asyncio
import base64
import io

import pytest
import torch
from PIL import Image

import r3srv.compat.vllm as vllm
from r3srv import LLM
from r3srv.errors import InvalidRequestError
from test_engine_vision import NEW_TOKENS, assert_matches_transformers, greedy, picture
from vision_testing import (FAMILIES, IMAGE_TOKEN, VISION_END, VISION_START, VISION_TOKENS, expanded,
                            write_vision_checkpoint)

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow  # transformers oracles

ENGINE = dict(block_size=4, num_kv_blocks=256, max_model_len=512, max_num_batched_tokens=24)
IMAGE_TEXT = "".join(VISION_TOKENS)  # how a text prompt shows an image: its delimited placeholder
VISION_IDS = [VISION_START, IMAGE_TOKEN, VISION_END]


@pytest.fixture(scope="module", params=list(FAMILIES))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf, processor = write_vision_checkpoint(transformers, request.param, path)
    return path, hf, processor


@pytest.fixture(scope="module")
def qwen3_vl(tmp_path_factory):
    """One family, for what does not depend on the family (refusals)."""
    path = tmp_path_factory.mktemp("qwen3_vl_moe")
    write_vision_checkpoint(transformers, "qwen3_vl_moe", path)
    return path


def data_uri(png: bytes) -> str:
    return f"data:image/png;base64,{base64.b64encode(png).decode()}"


def pil(png: bytes) -> Image.Image:
    return Image.open(io.BytesIO(png))


def hf_chat_ids(path, template_messages: list[dict], images: list[bytes], processor) -> list[int]:
    """The prompt transformers' tokenizer renders with the checkpoint's template, expanded by
    transformers' processor."""
    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(str(path))
    text = tokenizer.apply_chat_template(template_messages, add_generation_prompt=True, tokenize=False)
    return expanded(tokenizer.encode(text, add_special_tokens=False), images, processor, IMAGE_TOKEN)


def two_turns(first: dict, second: dict) -> tuple[list[dict], list[dict]]:
    """A conversation with an image in each user turn (as the client sends it, and as the
    chat template reads it)."""
    sent = [{"role": "user", "content": [{"type": "text", "text": "look: "}, first, {"type": "text", "text": "?"}]},
            {"role": "assistant", "content": "a cat"},
            {"role": "user", "content": [second, {"type": "text", "text": "and this?"}]}]
    seen = [{"role": "user", "content": [{"type": "text", "text": "look: "}, {"type": "image"},
                                         {"type": "text", "text": "?"}]},
            {"role": "assistant", "content": "a cat"},
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and this?"}]}]
    return sent, seen


def test_chat_with_image_url_and_image_pil_parts_matches_transformers(checkpoint):
    path, hf, processor = checkpoint
    images = [picture(1), picture(4)]
    sent, seen = two_turns({"type": "image_url", "image_url": {"url": data_uri(images[0])}},
                           {"type": "image_pil", "image_pil": pil(images[1])})
    out = LLM(str(path), **ENGINE).chat(sent, greedy())[0]
    assert out.prompt_token_ids == hf_chat_ids(path, seen, images, processor)
    assert len(out.image_grid_thw) == 2
    assert_matches_transformers(out, hf, processor, images)


def test_compat_generate_takes_a_text_prompt_with_multi_modal_data(checkpoint):
    """vLLM's TextPrompt with PIL images in multi_modal_data, and vLLM's chat with an image part,
    through r3srv.compat.vllm's LLM: transformers' tokens and rows."""
    path, hf, processor = checkpoint
    images = [picture(2), picture(0)]
    llm = vllm.LLM(str(path), enable_return_routed_experts=True, **ENGINE)
    prompt = {"prompt": f"two: {IMAGE_TEXT} then {IMAGE_TEXT} end",
              "multi_modal_data": {"image": [pil(png) for png in images]}}
    params = vllm.SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
    out = llm.generate(prompt, params)[0]
    ids = llm.get_tokenizer().encode(prompt["prompt"], add_special_tokens=True)
    assert out.prompt_token_ids == expanded(list(ids), images, processor, IMAGE_TOKEN)
    assert_matches_transformers(out, hf, processor, images)
    chat = llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_uri(images[0])}},
                                                  {"type": "text", "text": "hi"}]}], params)[0]
    assert chat.prompt_token_ids == hf_chat_ids(
        path, [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}], images[:1], processor)
    assert_matches_transformers(chat, hf, processor, images[:1])


def test_compat_async_generate_takes_multi_modal_data(checkpoint):
    path, hf, processor = checkpoint
    png = picture(3)
    prompt = {"prompt": f"x {IMAGE_TEXT} y", "multi_modal_data": {"image": png}}
    params = vllm.SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0,
                                 output_kind=vllm.RequestOutputKind.FINAL_ONLY)
    engine = vllm.AsyncLLM.from_engine_args(vllm.AsyncEngineArgs(str(path), enable_return_routed_experts=True,
                                                                 **ENGINE))

    async def main():
        return [o async for o in engine.generate(prompt, params, "img")][-1]

    try:
        out = asyncio.run(main())
    finally:
        engine.shutdown()
    assert out.image_grid_thw and IMAGE_TOKEN in out.prompt_token_ids
    assert_matches_transformers(out, hf, processor, [png])


@pytest.mark.parametrize("part,param,match", [
    ({"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}, "messages[0].content[1]", "video_url"),
    ({"type": "image_embeds", "image_embeds": "AAAA"}, "messages[0].content[1]", "image_embeds"),
    ({"type": "image_url", "image_url": {"url": "http://127.0.0.1:1/cat.png"}}, "messages[0].content[1].image_url",
     "data:image"),
    ({"type": "image_url", "image_url": "data:text/html;base64,PGh0bWw+"}, "messages[0].content[1].image_url",
     "not an image"),
    ({"type": "image_pil", "image_pil": "not an image"}, "messages[0].content[1].image_pil", "PIL image"),
])
def test_chat_parts_r3srv_does_not_take_are_400s_naming_the_part(qwen3_vl, part, param, match):
    llm = LLM(str(qwen3_vl), **ENGINE)
    with pytest.raises(InvalidRequestError, match=match) as exc:
        llm.chat([{"role": "user", "content": [{"type": "text", "text": "a"}, part]}], greedy())
    assert exc.value.param == param
    assert llm.stats().num_running == 0 and not llm.engine.requests


def hf_image_embeds(hf, processor, images: list[bytes]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' tower output for `images` in vLLM's image_embeds layout (the embeddings,
    then Qwen3-VL's deepstack features, side by side), and their grids."""
    batch = processor(images=[pil(png) for png in images], return_tensors="pt")
    with torch.no_grad():
        out = hf.model.visual(batch["pixel_values"], grid_thw=batch["image_grid_thw"], return_dict=True)
    return torch.cat([out.pooler_output, *(getattr(out, "deepstack_features", None) or [])], dim=1), \
        batch["image_grid_thw"]


def test_pre_computed_image_embeds_match_transformers_without_the_tower(checkpoint):
    """vLLM's {"image_embeds", "image_grid_thw"} entry (two images in one entry) for the tower's
    output: transformers' tokens and rows from the pixels, and the tower never ran."""
    path, hf, processor = checkpoint
    images = [picture(1), picture(5)]
    embeds, grids = hf_image_embeds(hf, processor, images)
    llm = vllm.LLM(str(path), enable_return_routed_experts=True, **ENGINE)
    ids = [1, 2, *VISION_IDS, 3, *VISION_IDS, 4]
    params = vllm.SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
    out = llm.generate({"prompt_token_ids": ids,
                        "multi_modal_data": {"image": {"image_embeds": embeds, "image_grid_thw": grids}}}, params)[0]
    assert llm.r3srv.engine.runner.encoder.images_encoded == 0
    assert out.prompt_token_ids == expanded(ids, images, processor, IMAGE_TOKEN)
    assert out.image_grid_thw == [tuple(g) for g in grids.tolist()]
    assert_matches_transformers(out, hf, processor, images)


def test_pre_computed_embeds_cost_no_encoder_budget(qwen3_vl):
    """With a budget below one image, two images' pixels prefill in two steps (one encoding
    each); the same images given as embeddings prefill in one."""
    hf, processor = write_vision_checkpoint(transformers, "qwen3_vl_moe", qwen3_vl.parent / "again")  # the same seed
    images = [picture(1), picture(5)]
    embeds, grids = hf_image_embeds(hf, processor, images)
    ids = [1, *VISION_IDS, 2, *VISION_IDS, 3]

    def prefill_steps(entry) -> int:
        llm = LLM(str(qwen3_vl), **{**ENGINE, "max_num_encoder_tokens": 1, "max_num_batched_tokens": 512})
        llm.engine.add_request("r", {"prompt_token_ids": ids, "multi_modal_data": {"image": entry}},
                               greedy())
        steps = 0
        while not any(out.outputs[0].token_ids for out in llm.engine.step().outputs):
            steps += 1
        return steps + 1

    assert prefill_steps(images) == 2
    assert prefill_steps({"image_embeds": embeds, "image_grid_thw": grids}) == 1


def test_compat_refuses_bad_embeddings_other_features_and_processor_overrides(qwen3_vl):
    llm = vllm.LLM(str(qwen3_vl), **ENGINE)
    embeds = torch.zeros(4, 96)  # Qwen3-VL's tiny tower: 32 wide, two deepstack sets
    for entry, param, match in [
        ({"image_embeds": embeds[:, :32], "image_grid_thw": [1, 4, 4]}, "multi_modal_data[0].image_embeds", "96"),
        ({"image_embeds": embeds[:3], "image_grid_thw": [1, 4, 4]}, "multi_modal_data[0].image_embeds", "take 4"),
        ({"image_embeds": embeds, "image_grid_thw": [1, 3, 4]}, "multi_modal_data[0].image_grid_thw", "multiples"),
        ({"image_embeds": embeds, "image_grid_thw": [1, 4, 4], "image_sizes": [8, 8]},
         "multi_modal_data[0].image_sizes", "not supported"),
    ]:
        with pytest.raises(InvalidRequestError, match=match) as exc:
            llm.generate({"prompt_token_ids": [1, *VISION_IDS], "multi_modal_data": {"image": entry}})
        assert exc.value.param == param
    for prompt, param in [
        ({"prompt": IMAGE_TEXT, "multi_modal_data": {"image_embeds": [[0.0] * 32]}}, "multi_modal_data.image_embeds"),
        ({"prompt": IMAGE_TEXT, "multi_modal_data": {"pixel_values": [[0.0]]}}, "multi_modal_data.pixel_values"),
        ({"prompt": IMAGE_TEXT, "multi_modal_data": {"image": picture(0)}, "mm_processor_kwargs": {"min_pixels": 4}},
         "prompt.mm_processor_kwargs"),
    ]:
        with pytest.raises(InvalidRequestError) as exc:
            llm.generate(prompt)
        assert exc.value.param == param
