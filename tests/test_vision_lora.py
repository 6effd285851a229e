"""An image prompt under a LoRA adapter, on a tiny random Qwen3-VL-MoE checkpoint with a PEFT
adapter on its language model's attention: offline and on a real server (image_url part,
model = the adapter's name), the expanded prompt's greedy tokens and every position's routed
experts equal PEFT + transformers' with the adapter, differ from the base model's, and the
server's equal the in-process engine's; the same image under the base model and the adapter
shares no cached block."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest
import torch
from server_fixture import TEST_SERVER_ARGS, RemoteServer

from r3srv import LLM, SamplingParams
from r3srv.serial import decode_routed_experts
from test_engine_vision import NEW_TOKENS, assert_matches_transformers, greedy, picture
from vision_testing import write_vision_checkpoint

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

pytestmark = pytest.mark.slow  # PEFT + transformers oracles, a real server

# the language model's attention (the vision tower's are qkv / proj: not matched)
TARGETS = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj)"
ENGINE = dict(block_size=4, num_kv_blocks=256, max_model_len=512, enable_lora=True, max_lora_rank=8)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The checkpoint, the adapter PEFT saved, and transformers' model with the adapter in it
    (its `disable_adapter()` context: the base model) and processor."""
    root = tmp_path_factory.mktemp("vision_lora")
    hf, processor = write_vision_checkpoint(transformers, "qwen3_vl_moe", root / "ckpt")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False)
    wrapped = peft.get_peft_model(hf, config)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in sorted(wrapped.named_parameters()):
            if "lora_" in name:  # large enough to move the router's picks
                p.copy_(torch.randn(p.shape, generator=g) * 1.5 / p.shape[-1] ** 0.5)
    wrapped.save_pretrained(root / "adapter")
    return root / "ckpt", root / "adapter", hf, wrapped, processor


def messages(png: bytes) -> list[dict]:
    url = f"data:image/png;base64,{base64.b64encode(png).decode()}"
    return [{"role": "user", "content": [{"type": "text", "text": "see "}, {"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": " now"}]}]


def test_offline_adapter_matches_peft_and_keeps_its_own_prefix_cache(files):
    ckpt, adapter, hf, wrapped, processor = files
    llm = LLM(str(ckpt), **ENGINE)
    llm.load_lora_adapter("a", str(adapter))
    png = picture(1)
    base = llm.chat(messages(png), greedy())[0]
    tuned = llm.chat(messages(png), greedy(), lora_name="a")[0]
    assert tuned.prompt_token_ids == base.prompt_token_ids
    assert tuned.num_cached_tokens == 0  # the base model's blocks of the same image are not the adapter's
    assert_matches_transformers(tuned, hf, processor, [png])  # the adapter is in hf's layers
    with wrapped.disable_adapter():
        assert_matches_transformers(base, hf, processor, [png])
    assert not np.array_equal(tuned.outputs[0].routed_experts, base.outputs[0].routed_experts)
    again = llm.chat(messages(png), greedy(), lora_name="a")[0]
    assert again.num_cached_tokens > 0  # its own blocks hit
    assert np.array_equal(again.outputs[0].routed_experts, tuned.outputs[0].routed_experts)


def test_server_image_url_under_an_adapter_equals_the_engine_and_peft(files):
    ckpt, adapter, hf, wrapped, processor = files
    png = picture(4)
    args = (str(ckpt), "--served-model-name", "base", "--enable-lora", "--max-lora-rank", "8",
            "--lora-modules", f"a={adapter}", "--enable-return-routed-experts", "--enable-prompt-tokens-details",
            "--dtype", "float32", "--max-model-len", "512", *TEST_SERVER_ARGS)

    def chat(srv, model: str) -> dict:
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=300, json={
            "model": model, "messages": messages(png), "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "routed_experts_prompt_start": 0})
        assert r.status_code == 200, r.text
        return r.json()

    with RemoteServer(*args) as srv:
        base, tuned = chat(srv, "base"), chat(srv, "a")
    assert srv.returncode == 0, srv.log
    assert tuned["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # not the base model's blocks
    llm = LLM(str(ckpt), **ENGINE)
    llm.load_lora_adapter("a", str(adapter))
    own = llm.chat(messages(png), SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True,
                                                 logprobs=0), lora_name="a")[0]
    rows = decode_routed_experts(tuned["choices"][0]["routed_experts"])
    assert tuned["prompt_token_ids"] == own.prompt_token_ids
    assert tuned["choices"][0]["token_ids"] == own.outputs[0].token_ids
    assert np.array_equal(rows, own.outputs[0].routed_experts)
    assert_matches_transformers(own, hf, processor, [png])
    assert not np.array_equal(rows, decode_routed_experts(base["choices"][0]["routed_experts"]))
