"""DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5) beyond the transformers oracle tests:
released config.json spellings, the cache they need, and that a context within index_topk is
attended densely (the indexer then selects every visible key)."""

from __future__ import annotations

import pytest
import torch

from r3srv.errors import ConfigError
from r3srv.models.config import ModelConfig
from r3srv.models.loader import load_model
from model_testing import prefill
from tiny_checkpoints import write_tiny_checkpoint

pytest.importorskip("transformers")

# DeepSeek-V3.2-Exp's config.json: block FP8 (with DeepSeek's ue8m0 scale format), YaRN, an MTP layer
DEEPSEEK_V32 = {
    "architectures": ["DeepseekV32ForCausalLM"], "attention_bias": False, "bos_token_id": 0, "eos_token_id": 1,
    "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168, "index_head_dim": 128,
    "index_n_heads": 64, "index_topk": 2048, "intermediate_size": 18432, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "model_type": "deepseek_v32", "moe_intermediate_size": 2048,
    "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "tie_word_embeddings": False,
    "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "v_head_dim": 128, "vocab_size": 129280,
}

# GLM-5's shape as transformers' GlmMoeDsaConfig describes it, with a shared-indexer pattern
GLM5 = {
    "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "hidden_size": 6144,
    "intermediate_size": 12288, "moe_intermediate_size": 2048, "num_hidden_layers": 78, "num_attention_heads": 64,
    "num_key_value_heads": 64, "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512, "q_lora_rank": 2048, "qk_rope_head_dim": 64, "v_head_dim": 256, "qk_nope_head_dim": 192,
    "n_group": 1, "topk_group": 1, "num_experts_per_tok": 8, "norm_topk_prob": True, "max_position_embeddings": 202752,
    "rms_norm_eps": 1e-05, "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 32, "first_k_dense_replace": 3,
    "index_topk_freq": 4, "index_skip_topk_offset": 2, "vocab_size": 154880, "torch_dtype": "bfloat16",
    "rope_parameters": {"rope_theta": 1000000, "rope_type": "default"},
}


def test_deepseek_v32_released_config_spelling():
    cfg = ModelConfig.from_dict(DEEPSEEK_V32)
    assert cfg.model_type == "deepseek_v32" and cfg.is_mla and cfg.rope.interleave
    assert (cfg.attention.sparse.topk, cfg.attention.sparse.n_heads, cfg.attention.sparse.head_dim) == (2048, 64, 128)
    assert not cfg.attention.sparse.rope_interleave and cfg.attention.sparse.shared_layers == []
    assert cfg.moe_layers == list(range(3, 61)) and (cfg.router.num_groups, cfg.router.topk_groups) == (8, 4)
    assert cfg.fp8_block == (128, 128) and cfg.rope.yarn["factor"] == 40
    # per token and layer: the 576-value latent and a 128-value index key
    assert cfg.kv_cache_bytes_per_block(64, torch.bfloat16) == 61 * (576 + 128) * 64 * 2


def test_glm5_shared_indexers_follow_transformers_rule():
    cfg = ModelConfig.from_dict(GLM5)
    assert cfg.model_type == "glm_moe_dsa" and cfg.attention.sparse.rope_interleave
    # transformers: layer i is full when max(i - offset + 1, 0) % freq == 0
    full = [i for i in range(78) if i not in cfg.attention.sparse.shared_layers]
    assert full[:4] == [0, 1, 5, 9] and len(full) == 21
    assert cfg.kv_cache_bytes_per_block(16, torch.bfloat16) == (78 * 576 + 21 * 128) * 16 * 2
    pattern = ModelConfig.from_dict({**GLM5, "num_hidden_layers": 4, "index_topk_pattern": "FSSF"})
    assert pattern.attention.sparse.shared_layers == [1, 2]


@pytest.mark.parametrize("change, match", [
    ({"indexer_types": ["shared"] + ["full"] * 77}, "the first full"),
    ({"q_lora_rank": None}, "q_lora_rank"),
    ({"scoring_func": "softmax"}, "sigmoid"),
])
def test_bad_sparse_attention_configs_are_config_errors(change, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_dict({**GLM5, **change})


def test_a_context_within_index_topk_is_attended_densely(tmp_path):
    """With index_topk at least the prompt, DSA is plain MLA: the same logits and routing as the
    checkpoint read as DeepSeek-V3 (whose weights it holds, less the indexer's)."""
    path = write_tiny_checkpoint(tmp_path / "v32", "deepseek_v32", seed=2)
    model, _ = load_model(path)
    for layer in model.layers:
        layer.attn.indexer.topk = 64
    dense, _ = load_model(path)
    for layer in dense.layers:  # the same weights attending densely
        layer.attn.indexer = None
    prompt = list(range(40, 60))
    logits, rows = prefill(model, prompt, all_logits=True)
    want_logits, want_rows = prefill(dense, prompt, all_logits=True)
    assert torch.equal(logits, want_logits) and torch.equal(rows, want_rows)
    sparse, _ = load_model(path)  # top-5 of 20 keys: a different forward
    assert not torch.allclose(prefill(sparse, prompt, all_logits=True)[0], want_logits)


def test_prefix_hits_reuse_the_cached_index_keys(tmp_path):
    """A prompt served from the prefix cache attends through index keys it never computed:
    they were cached per token with the latents, so its outputs equal a cold run's."""
    import numpy as np

    from r3srv import LLM, SamplingParams

    path = str(write_tiny_checkpoint(tmp_path / "glm5", "glm_moe_dsa", seed=9, num_layers=3,
                                     indexer_types=["full", "shared", "full"]))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompt = list(range(40, 70))  # 30 tokens: a top-5 selection from the first blocks on
    cold = LLM(path, max_model_len=64, block_size=4, enable_prefix_caching=False).generate([prompt], params)[0]
    llm = LLM(path, max_model_len=64, block_size=4)
    llm.generate([prompt], params)
    warm = llm.generate([prompt + [71, 72]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
    again = llm.generate([prompt], params)[0]
    assert again.num_cached_tokens == 28 and warm.num_cached_tokens == 28
    assert again.outputs[0].token_ids == cold.outputs[0].token_ids
    np.testing.assert_array_equal(again.outputs[0].routed_experts, cold.outputs[0].routed_experts)
