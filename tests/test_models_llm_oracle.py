"""End to end through the offline LLM: for each family, greedy tokens and the returned routed
experts equal what transformers computes on the same prompt and output, from its own router."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from r3srv import LLM, SamplingParams
from tiny_checkpoints import FAMILIES, build_hf_model, hf_forward_with_gate_hook, hf_router_ids, write_tiny_checkpoint

pytestmark = pytest.mark.slow  # transformers oracles

pytest.importorskip("transformers")

MAX_TOKENS = 8


def _hf_greedy(hf, prompt: list[int], steps: int) -> list[int]:
    tokens = list(prompt)
    past = None
    with torch.no_grad():
        new = tokens
        for _ in range(steps):
            out = hf(torch.tensor([new]), past_key_values=past, use_cache=True)
            past = out.past_key_values
            new = [int(out.logits[0, -1].argmax())]
            tokens += new
    return tokens[len(prompt) :]


def _hf_routing(hf, tokens: list[int], num_layers: int, top_k: int) -> np.ndarray:
    """[len(tokens), num_layers, top_k] router top-k of one transformers forward; dense layers zero."""
    rows = np.zeros((len(tokens), num_layers, top_k), dtype=np.int64)

    def hook(layer, gate, inp, out):
        rows[:, layer] = hf_router_ids(gate, inp, out).numpy()

    hf_forward_with_gate_hook(hf, tokens, hook)
    return rows


@pytest.mark.parametrize("family", FAMILIES)
def test_llm_greedy_tokens_and_routed_experts_match_transformers(family, tmp_path):
    kwargs = {"num_layers": 3, "mlp_only_layers": [1]} if family == "qwen3_moe" else {}
    path = write_tiny_checkpoint(tmp_path / family, family, seed=11, **kwargs)
    hf = build_hf_model(family, seed=11, **kwargs)
    llm = LLM(str(path), block_size=4, num_kv_blocks=64, max_model_len=128)
    cfg = llm.model_config
    prompts = [list(b"Routing replay!"), list(b"MoE")]
    params = [
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, routed_experts_prompt_start=start)
        for start in (0, 2)
    ]
    outputs = llm.generate(prompts, params)
    for prompt, param, out in zip(prompts, params, outputs):
        tokens = list(out.outputs[0].token_ids)
        assert tokens == _hf_greedy(hf, prompt, MAX_TOKENS)
        full = prompt + tokens
        expected = _hf_routing(hf, full[:-1], cfg.num_layers, cfg.top_k)[param.routed_experts_prompt_start :]
        routed = out.outputs[0].routed_experts
        assert routed.dtype == np.uint8
        assert routed.shape == (len(full) - 1 - param.routed_experts_prompt_start, cfg.num_layers, cfg.top_k)
        np.testing.assert_array_equal(routed.astype(np.int64), expected)
        if family == "qwen3_moe":
            assert not routed[:, 1].any() and routed[:, 0].any()  # dense layer 1: zero rows
