"""The prefill floor's FLOP count (benches/prefill_floor.py) against an independent count: torch's
FlopCounterMode over transformers' own Qwen3-MoE forward (eager attention and experts, so
every product is a counted matmul; it multiplies every query by every key and computes every
position's logits, which prompt_flops is told), on generated configs and prompt lengths."""

from __future__ import annotations

import random

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from prefill_floor import floor_line, prompt_flops

from r3srv.models.builtin import builtin_config

transformers = pytest.importorskip("transformers")


def generated_configs(count: int, seed: int = 20261204) -> list[dict]:
    """The built-in model's config and `count` variations of its shape: heads, KV heads, head
    size, experts, top-k, dense layers among the MoE ones."""
    rng = random.Random(seed)
    base = {k: v for k, v in builtin_config().items() if not k.startswith("r3srv")}
    configs = [base]
    for _ in range(count):
        kv_heads = rng.choice([1, 2, 4])
        config = dict(base, hidden_size=rng.choice([32, 64, 96]), num_hidden_layers=rng.randint(1, 4),
                      num_key_value_heads=kv_heads, num_attention_heads=kv_heads * rng.choice([1, 2, 3]),
                      head_dim=rng.choice([8, 16, 24]), num_experts=rng.choice([4, 8, 12]),
                      moe_intermediate_size=rng.choice([8, 24]), intermediate_size=rng.choice([16, 40]),
                      decoder_sparse_step=rng.choice([1, 2]))
        config["num_experts_per_tok"] = rng.randint(1, config["num_experts"] // 2)
        config["mlp_only_layers"] = sorted(rng.sample(range(config["num_hidden_layers"]), rng.randint(0, 1)))
        configs.append(config)
    return configs


@pytest.mark.parametrize("index", range(6))
def test_prompt_flops_match_transformers_counted(index: int) -> None:
    config = generated_configs(5)[index]
    hf = transformers.Qwen3MoeConfig(**config)
    hf._attn_implementation = "eager"
    hf._experts_implementation = "eager"
    torch.manual_seed(index)
    model = transformers.Qwen3MoeForCausalLM(hf).eval()
    for tokens in (1, 7, 37):
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model(torch.randint(0, config["vocab_size"], (1, tokens)))
        assert prompt_flops(config, tokens, causal=False, lm_head_tokens=tokens) == counter.get_total_flops(), (
            index, tokens)


def test_causal_attention_counts_each_query_against_itself_and_earlier_keys() -> None:
    config = builtin_config()
    attention = 2 * 2 * config["num_attention_heads"] * config["head_dim"] * config["num_hidden_layers"]
    full, causal = prompt_flops(config, 100, causal=False), prompt_flops(config, 100)
    assert full - causal == attention * (100 * 100 - 100 * 101 // 2)


def test_the_last_layers_mlp_counts_only_the_tokens_whose_logits_are_computed() -> None:
    config = builtin_config()
    hidden, experts = config["hidden_size"], config["num_experts_per_tok"] * 3 * config["moe_intermediate_size"]
    every, last = prompt_flops(config, 100, lm_head_tokens=100), prompt_flops(config, 100)
    assert every - last == 2 * 99 * hidden * (config["vocab_size"] + experts)


def test_other_families_are_refused() -> None:
    with pytest.raises(ValueError, match="Qwen3-MoE"):
        prompt_flops({"model_type": "llama"}, 10)


def test_floor_line_names_each_time_against_the_floor() -> None:
    line = floor_line(builtin_config(), 64, "float32", 1, {"r3srv": 1.0, "vLLM": 2.0})
    assert "prefill floor, 64 tokens, float32, 1 thread(s)" in line
    ratios = [float(part.split("= ")[1].rstrip("x")) for part in line.split("; ")[1].split(", ")]
    assert ratios[1] == pytest.approx(2 * ratios[0], rel=0.02)
