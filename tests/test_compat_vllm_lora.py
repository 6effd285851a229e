"""vLLM's LoRARequest through r3srv.compat.vllm: code written for vLLM names an adapter per
request by (name, id, path); the compat layer loads it the first time its id is seen (again with
load_inplace) and selects it by name. The oracle is PEFT + transformers on a tiny checkpoint."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from lora_testing import assert_matches, checkpoint_and_two_adapters, peft_reference, prompt

import r3srv.compat.vllm as vllm
from r3srv.errors import InvalidRequestError

pytestmark = pytest.mark.slow  # PEFT + transformers oracles, engines on a tiny checkpoint

FAMILY, MAX_TOKENS = "qwen3_moe", 5
ENGINE = dict(enable_lora=True, max_loras=2, max_lora_rank=8, max_model_len=96, num_kv_blocks=64, block_size=8,
              dtype="float32", enable_return_routed_experts=True)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return checkpoint_and_two_adapters(tmp_path_factory.mktemp("compat_lora"), FAMILY)


@pytest.fixture(scope="module")
def references(files):
    _, a1, a2 = files
    prompts = [prompt(11, 7), prompt(11, 7), prompt(9, 8)]
    return prompts, [peft_reference(FAMILY, path, p, MAX_TOKENS) for p, path in zip(prompts, [a1, None, a2])]


def greedy():
    return vllm.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0)


def version(llm, name):
    return llm.r3srv.engine.core.lora_ref(name).version


def test_offline_lora_requests_alone_and_mixed_match_peft(files, references):
    ckpt, a1, a2 = files
    prompts, refs = references
    llm = vllm.LLM(str(ckpt), **ENGINE)
    r1, r2 = vllm.LoRARequest("a1", 1, str(a1)), vllm.LoRARequest("a2", 2, str(a2))
    assert refs[0].tokens != refs[1].tokens  # the adapter changes what the model says
    mixed = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(), lora_request=[r1, None, r2])
    for out, ref in zip(mixed, refs):
        assert_matches(out, ref)
    assert version(llm, "a1") == version(llm, "a2") == 1
    alone = llm.generate({"prompt_token_ids": prompts[0]}, greedy(), lora_request=r1)  # loaded once, by id
    assert_matches(alone[0], refs[0])
    assert version(llm, "a1") == 1
    llm.generate({"prompt_token_ids": prompts[0]}, greedy(), lora_request=vllm.LoRARequest("a1", 1, str(a1),
                                                                                           load_inplace=True))
    assert version(llm, "a1") == 2  # load_inplace reads it again, as vLLM's
    with pytest.raises(InvalidRequestError, match="one id per adapter") as exc:
        llm.generate(prompts[0], greedy(), lora_request=vllm.LoRARequest("other", 1, str(a2)))
    assert exc.value.param == "lora_request"
    with pytest.raises(InvalidRequestError, match="names no lora_path"):  # vLLM's own class refuses an empty path
        llm.generate(prompts[0], greedy(), lora_request=SimpleNamespace(lora_name="a3", lora_int_id=3, lora_path=""))
    with pytest.raises(InvalidRequestError, match="2 lora_request for 1 prompts"):
        llm.generate([prompts[0]], greedy(), lora_request=[r1, r2])
    with pytest.raises(ValueError, match="id must be > 0"):
        vllm.LoRARequest("a0", 0, str(a1))


def test_async_add_list_remove_and_generate(files, references):
    ckpt, a1, _ = files
    prompts, refs = references

    async def run():
        engine = vllm.AsyncLLM(str(ckpt), **ENGINE)
        try:
            request = vllm.LoRARequest("a1", 7, str(a1))
            assert await engine.add_lora(request) and await engine.list_loras() == {7}

            async def one(rid, lora):
                outs = [out async for out in engine.generate({"prompt_token_ids": prompts[0]}, greedy(), rid,
                                                             lora_request=lora)]
                return outs[-1]

            with_adapter, base = await asyncio.gather(one("x", request), one("y", None))
            assert await engine.remove_lora(7) and await engine.list_loras() == set()
            assert not await engine.remove_lora(7)
            again = await one("z", request)  # removed, so named again it loads again from its path
            return with_adapter, base, again, await engine.list_loras()
        finally:
            engine.shutdown()

    with_adapter, base, again, listed = asyncio.run(run())
    assert_matches(with_adapter, refs[0])
    assert_matches(again, refs[0])
    assert base.outputs[0].token_ids == refs[1].tokens
    assert listed == {7}
