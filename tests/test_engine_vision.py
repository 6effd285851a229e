"""Image prompts through the whole engine (LLM.generate with vLLM's multi_modal_data) against
transformers' image-text models on tiny random checkpoints of the three families: the expanded
prompt, greedy tokens, their logprobs and the routed experts of every position (image
placeholders included), batched with text-only prompts and chunked across image tokens; a
second turn re-sending an image hits the prefix cache and the encoder cache and still equals a
cold run; two prompts alike but for their images share no image block; preemption keeps rows
exact; bad images are 400s naming the field; release_memory takes the tower along and drops its
cached outputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from r3srv import LLM, SamplingParams
from r3srv.errors import InvalidRequestError
from vision_testing import (FAMILIES, IMAGE_CASES, IMAGE_TOKEN, VISION_END, VISION_START, expanded, hf_greedy,
                            image_bytes, image_grids, write_vision_checkpoint)

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow  # transformers oracles

NEW_TOKENS = 4
START, END = VISION_START, VISION_END


@pytest.fixture(scope="module", params=list(FAMILIES))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf, processor = write_vision_checkpoint(transformers, request.param, path)
    return path, hf, processor


def picture(case: int, seed: int | None = None) -> bytes:
    width, height, mode, fmt = IMAGE_CASES[case]
    return image_bytes(width, height, mode, fmt, seed=case if seed is None else seed)


def text(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 200, n).tolist()


def with_placeholders(*parts) -> list[int]:
    """Token ids: lists of text ids, and an int k for an image (its delimiters and one placeholder)."""
    ids = []
    for part in parts:
        ids += [START, IMAGE_TOKEN, END] if isinstance(part, int) else part
    return ids


def greedy(logprobs: bool = True) -> SamplingParams:
    return SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0 if logprobs else None)


def assert_matches_transformers(out, hf, processor, images: list[bytes]):
    ids = out.prompt_token_ids
    tokens, logprobs, rows = hf_greedy(hf, ids, images, processor, IMAGE_TOKEN, NEW_TOKENS)
    sample = out.outputs[0]
    assert sample.token_ids == tokens
    got = [entry[t] for entry, t in zip(sample.logprobs, sample.token_ids)]
    got = [g.logprob if hasattr(g, "logprob") else g for g in got]
    np.testing.assert_allclose(got, logprobs, rtol=1e-4, atol=5e-4)
    experts = sample.routed_experts
    assert experts.shape[0] == len(ids) + NEW_TOKENS - 1
    for layer in range(experts.shape[1]):
        if layer in rows:  # every position's picks, the image placeholders' included
            assert np.array_equal(experts[:, layer], rows[layer].numpy()), f"layer {layer}"
        else:
            assert not experts[:, layer].any()


def make_llm(path, **kwargs) -> LLM:
    options = dict(block_size=4, num_kv_blocks=256, max_model_len=512, max_num_batched_tokens=24)
    return LLM(str(path), **{**options, **kwargs})


def test_image_prompts_batched_with_text_match_transformers(checkpoint):
    """One image, two images (image, text, image), and a text-only prompt in one batch; prefills
    of 24 tokens at most, so images are cut across steps."""
    path, hf, processor = checkpoint
    llm = make_llm(path)
    one, two = [picture(0)], [picture(1), picture(5)]
    prompts = [
        {"prompt_token_ids": with_placeholders(text(5, 1), 0, text(4, 2)), "multi_modal_data": {"image": one[0]}},
        {"prompt_token_ids": with_placeholders(1, text(3, 3), 1, text(6, 4)), "multi_modal_data": {"image": two}},
        text(9, 5),
    ]
    outs = llm.generate(prompts, greedy())
    for out, prompt, images in zip(outs, prompts, [one, two, []]):
        ids = prompt["prompt_token_ids"] if isinstance(prompt, dict) else prompt
        assert out.prompt_token_ids == expanded(ids, images, processor, IMAGE_TOKEN)
        assert out.image_grid_thw == ([tuple(g) for g in image_grids(images, processor)] if images else None)
        assert_matches_transformers(out, hf, processor, images)


def test_the_encoder_budget_splits_a_prefill_before_an_image_that_would_pass_it(checkpoint):
    """With a budget below one image, a prompt of two images prefills in two steps, each
    encoding one image (an image larger than the budget runs alone), and still equals transformers."""
    path, hf, processor = checkpoint
    llm = make_llm(path, max_num_encoder_tokens=1, max_num_batched_tokens=512)
    images = [picture(1), picture(5)]
    prompt = {"prompt_token_ids": with_placeholders(text(3, 12), 0, text(4, 13), 1, text(2, 14)),
              "multi_modal_data": {"image": images}}
    out = llm.generate(prompt, greedy())[0]
    encoder = llm.engine.runner.encoder
    sizes = [image.num_tokens(2) for image in llm.engine.input_processor.expand_images(
        prompt["prompt_token_ids"], images, param="x")[1].images]
    assert encoder.images_encoded == 2 and encoder.most_tokens_encoded == max(sizes) < sum(sizes)
    assert_matches_transformers(out, hf, processor, images)


def test_second_turn_hits_the_prefix_and_encoder_caches_and_equals_a_cold_run(checkpoint):
    path, hf, processor = checkpoint
    llm = make_llm(path)
    image = picture(2)
    first = with_placeholders(text(6, 6), 0, text(3, 7))
    out = llm.generate({"prompt_token_ids": first, "multi_modal_data": {"image": image}}, greedy())[0]
    encoder = llm.engine.runner.encoder
    encoded, hits = encoder.images_encoded, llm.stats().prefix_cache_hits
    second = first + out.outputs[0].token_ids + with_placeholders(text(2, 8), 0, text(3, 9))
    again = llm.generate({"prompt_token_ids": second, "multi_modal_data": {"image": [image, image]}}, greedy())[0]
    assert encoder.images_encoded == encoded  # the image came from the encoder cache
    assert llm.stats().prefix_cache_hits - hits >= len(out.prompt_token_ids) // 4 * 4 - 4  # the first turn's blocks
    assert_matches_transformers(again, hf, processor, [image, image])


def test_prompts_alike_but_for_their_images_share_no_image_block(checkpoint):
    path, hf, processor = checkpoint
    llm = make_llm(path)
    ids = with_placeholders(text(8, 10), 0, text(5, 11))
    images = [picture(0, seed=20), picture(0, seed=21)]  # the same size: the same placeholder ids
    outs = [llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": image}}, greedy())[0]
            for image in images + images[:1]]
    assert outs[0].prompt_token_ids == outs[1].prompt_token_ids
    # the blocks wholly before the first placeholder hit (a hybrid resumes only at a state
    # snapshot: its prompt's last full block, past the image, so none); the first image again
    # hits its blocks too
    before_image = 0 if llm.model_config.is_hybrid else (len(text(8, 10)) + 1) // 4 * 4
    assert outs[1].num_cached_tokens == before_image
    assert outs[2].num_cached_tokens > (len(text(8, 10)) + 1) // 4 * 4
    for out, image in zip(outs, images + images[:1]):
        assert_matches_transformers(out, hf, processor, [image])


def test_preemption_recomputes_image_rows_exactly(checkpoint):
    path, hf, processor = checkpoint
    llm = make_llm(path, num_kv_blocks=24, max_model_len=96, enable_prefix_caching=False)
    prompts = [{"prompt_token_ids": with_placeholders(text(3, 30 + k), 0, text(3, 40 + k)),
                "multi_modal_data": {"image": picture(k)}} for k in (0, 3, 4)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert llm.engine.scheduler.num_preemptions > 0
    for out, k in zip(outs, (0, 3, 4)):
        tokens, _, rows = hf_greedy(hf, out.prompt_token_ids, [picture(k)], processor, IMAGE_TOKEN, 12)
        assert out.outputs[0].token_ids == tokens
        for layer, want in rows.items():
            assert np.array_equal(out.outputs[0].routed_experts[:, layer], want.numpy()), f"layer {layer}"


@pytest.mark.parametrize("prompt,match,param", [
    ({"prompt_token_ids": [1, 2, IMAGE_TOKEN, 3], "multi_modal_data": {"image": b"\x89PNG\r\n\x1a\n broken"}},
     "could not be decoded|not an image", "multi_modal_data[0]"),
    ({"prompt_token_ids": [1, 2, 3], "multi_modal_data": {"image": picture(0)}}, "0 image placeholders",
     "multi_modal_data"),
    ({"prompt_token_ids": [1, IMAGE_TOKEN, IMAGE_TOKEN, 2], "multi_modal_data": {"image": picture(0)}},
     "run of 2", "multi_modal_data[0]"),
    ({"prompt_token_ids": [1, IMAGE_TOKEN], "multi_modal_data": {"video": b"x"}}, "only images",
     "multi_modal_data.video"),
])
def test_bad_image_prompts_are_400s_naming_the_field(checkpoint, prompt, match, param):
    path, _, _ = checkpoint
    llm = make_llm(path)
    with pytest.raises(InvalidRequestError, match=match) as info:
        llm.generate(prompt, greedy())
    assert info.value.param == param
    assert llm.stats().kv_blocks_used == 0


def test_too_many_images_and_images_too_large_for_the_context_are_400s(checkpoint):
    path, _, _ = checkpoint
    llm = make_llm(path, max_images_per_prompt=2, max_model_len=24)
    three = {"prompt_token_ids": with_placeholders(0, 1, 2), "multi_modal_data": {"image": [picture(0)] * 3}}
    with pytest.raises(InvalidRequestError, match="at most 2") as info:
        llm.generate(three, greedy())
    assert info.value.param == "multi_modal_data"
    big = {"prompt_token_ids": with_placeholders(0), "multi_modal_data": {"image": picture(1)}}  # 40+ tokens
    with pytest.raises(InvalidRequestError, match="images take") as info:
        llm.generate(big, greedy())
    assert info.value.param == "multi_modal_data"


def image_prompt() -> dict:
    return {"prompt_token_ids": with_placeholders(text(4, 20), 0, text(3, 21)),
            "multi_modal_data": {"image": picture(3)}}


def _same_sample(a, b) -> bool:
    return (a.token_ids == b.token_ids and np.array_equal(a.routed_experts, b.routed_experts)
            and [e[t] for e, t in zip(a.logprobs, a.token_ids)] == [e[t] for e, t in zip(b.logprobs, b.token_ids)])


def test_release_memory_takes_the_tower_along_and_forgets_its_outputs(checkpoint, monkeypatch):
    """release_memory moves the vision tower's weights with the model's (on a GPU: to pinned
    host memory, test_release_gives_the_tower_memory_back) and drops the cached image outputs;
    after resume the image is encoded again and the answer is the one before."""
    from r3srv.engine import encoder_cache

    path, _, _ = checkpoint
    llm = make_llm(path)
    encoder = llm.engine.runner.encoder
    prompt = image_prompt()
    before = llm.generate(prompt, greedy())[0].outputs[0]
    assert encoder.images_encoded == 1 and encoder.num_cached() == 1
    weights = {name: p.clone() for name, p in encoder.tower.named_parameters()}
    moves, move = [], encoder_cache.move_parameters

    def recorded(module, device):
        moves.append((module, device))
        move(module, device)

    monkeypatch.setattr(encoder_cache, "move_parameters", recorded)
    assert llm.release_memory(["kv_cache"]) == ["kv_cache"]
    assert encoder.num_cached() == 0 and moves == []  # the outputs went with the cache; the tower stays
    assert llm.release_memory(["weights"]) == ["kv_cache", "weights"]
    assert moves == [(encoder.tower, "cpu")]
    assert llm.resume_memory() == []
    assert moves == [(encoder.tower, "cpu"), (encoder.tower, encoder.device)]
    for name, param in encoder.tower.named_parameters():
        assert param.device == encoder.device and torch.equal(param, weights[name]), name
    after = llm.generate(prompt, greedy())[0].outputs[0]
    assert encoder.images_encoded == 2  # encoded again: its cached output was dropped
    assert _same_sample(after, before)


@pytest.mark.gpu("the tower's weights leaving the GPU")
def test_release_gives_the_tower_memory_back(tmp_path):
    path = tmp_path / "qwen3_vl_moe"
    write_vision_checkpoint(transformers, "qwen3_vl_moe", path)
    llm = make_llm(path, device="cuda", dtype="float32")
    prompt = image_prompt()
    before = llm.generate(prompt, greedy())[0].outputs[0]
    tower = llm.engine.runner.encoder.tower
    llm.release_memory()
    assert all(p.device.type == "cpu" and p.is_pinned() for p in tower.parameters())
    llm.resume_memory()
    assert all(p.device.type == "cuda" for p in tower.parameters())
    assert _same_sample(llm.generate(prompt, greedy())[0].outputs[0], before)
