"""LoRA adapters under tensor and expert parallelism on CPU ranks (gloo): each rank binds its
own slices of the adapters rank 0 loads into a slot, and receives each step's adapter slots with
the batch; tokens, logprobs and routed-experts rows as PEFT + transformers compute them, adapters
mixed with each other and the base model in one batch, on a plain MoE (qwen3_moe) and on MLA with
shared experts (deepseek_v3), after an in-memory replacement."""

from __future__ import annotations

import pytest
from lora_testing import assert_matches, peft_reference, prompt, write_adapter, write_checkpoint
from safetensors.torch import load_file

from engine_testing import one_torch_thread  # noqa: F401 (autouse fixture)
from r3srv import LLM, SamplingParams
from r3srv.lora.manager import adapter_from_tensors

pytestmark = pytest.mark.slow  # worker processes (torch.distributed ranks), PEFT oracles

MAX_TOKENS = 5
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0)


@pytest.mark.parametrize("family, mode", [("qwen3_moe", "tp"), ("deepseek_v3", "ep")])
def test_adapters_on_split_ranks_match_peft(family, mode, tmp_path):
    import json

    ckpt = write_checkpoint(tmp_path / "ckpt", family)
    a1 = write_adapter(tmp_path / "a1", family, seed=1)
    a2 = write_adapter(tmp_path / "a2", family, seed=2, rank=8, alpha=4)
    llm = LLM(str(ckpt), enable_lora=True, max_loras=2, max_model_len=96, num_kv_blocks=64, block_size=8,
              tensor_parallel_size=2, enable_expert_parallel=mode == "ep", dtype="float32")
    try:
        llm.load_lora_adapter("a1", str(a1))
        llm.load_lora_adapter("a2", str(a2))
        prompts = [prompt(11, 7), prompt(11, 7), prompt(9, 8)]
        names = ["a1", None, "a2"]
        paths = {"a1": a1, "a2": a2, None: None}
        for out, p, name in zip(llm.generate(prompts, GREEDY, lora_name=names), prompts, names):
            assert_matches(out, peft_reference(family, paths[name], p, MAX_TOKENS))
        # the trainer's push: "a1" replaced in memory by a2's tensors, on every rank
        config = json.loads((a2 / "adapter_config.json").read_text())
        tensors = load_file(str(a2 / "adapter_model.safetensors"))
        assert llm.load_lora_adapter("a1", adapter=adapter_from_tensors(config, tensors)).version == 2
        out = llm.generate([prompts[0]], GREEDY, lora_name="a1")[0]
        assert_matches(out, peft_reference(family, a2, prompts[0], MAX_TOKENS))
    finally:
        llm.shutdown()
