"""What the transformers oracle tests (tests/families/, test_models_llm_oracle.py) do not
cover for the newer families (GLM-4.5, GLM-4.7-Flash, MiniMax-M2, DeepSeek-V3/V2, gpt-oss, ERNIE-4.5, dots.llm1,
Granite 3.x MoE, Qwen3-VL-MoE): their
released config.json spellings, a float32 router in a bfloat16 model, the MTP layer a
released checkpoint carries, and bad expert groups. (Quantized weights: test_models_quantized.py.)"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from r3srv.errors import ConfigError
from r3srv.models.config import ModelConfig
from r3srv.models.loader import load_model
from model_testing import prefill
from tiny_checkpoints import write_tiny_checkpoint

pytest.importorskip("transformers")

PROMPT = [72, 101, 108, 108, 111, 33, 10, 200, 7, 9]

# The keys and spellings of GLM-4.5-Air's released config.json (transformers 4.54 era):
# top-level rope_theta and partial_rotary_factor, n_routed_experts, an MTP layer.
GLM45_AIR_STYLE = {
    "architectures": ["Glm4MoeForCausalLM"],
    "attention_bias": True,
    "eos_token_id": [151329, 151336, 151338],
    "first_k_dense_replace": 1,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 10944,
    "max_position_embeddings": 131072,
    "model_type": "glm4_moe",
    "moe_intermediate_size": 1408,
    "n_group": 1,
    "n_routed_experts": 128,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 96,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 46,
    "num_key_value_heads": 8,
    "num_nextn_predict_layers": 1,
    "partial_rotary_factor": 0.5,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "routed_scaling_factor": 1.0,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "torch_dtype": "bfloat16",
    "use_qk_norm": False,
    "vocab_size": 151552,
}


# MiniMax-M2's released config.json spellings: rotary_dim instead of a factor, block-FP8
MINIMAX_M2_STYLE = {
    "architectures": ["MiniMaxM2ForCausalLM"],
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 3072,
    "intermediate_size": 1536,
    "max_position_embeddings": 196608,
    "model_type": "minimax_m2",
    "num_attention_heads": 48,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 62,
    "num_key_value_heads": 8,
    "num_local_experts": 256,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "float8_e4m3fn", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_theta": 5000000,
    "rotary_dim": 64,
    "scoring_func": "sigmoid",
    "shared_intermediate_size": 0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_qk_norm": True,
    "vocab_size": 200064,
}


# DeepSeek-V3's released config.json spellings (Kimi-K2 and Moonlight share them)
DEEPSEEK_V3_STYLE = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "v_head_dim": 128,
    "vocab_size": 129280,
}


def test_released_config_spelling_parses_to_the_glm_switches():
    cfg = ModelConfig.from_dict(GLM45_AIR_STYLE, name="glm-4.5-air")
    assert (cfg.model_type, cfg.num_experts, cfg.top_k, cfg.num_layers) == ("glm4_moe", 128, 8, 46)
    assert cfg.moe_layers == list(range(1, 46))  # first_k_dense_replace=1: layer 0 is dense
    assert cfg.rotary_dim == 64 and cfg.rope.theta == 1e6
    assert (cfg.router.scoring, cfg.router.correction_bias, cfg.router.float32, cfg.router.renormalize) == ("sigmoid", True, True, True)
    assert (cfg.router.num_groups, cfg.router.topk_groups, cfg.router.scaling) == (1, 1, 1.0)
    assert cfg.experts.shared_intermediate_size == 1408 and not cfg.experts.shared_gate
    assert cfg.attention.qkv_bias and not cfg.attention.o_bias and cfg.attention.qk_norm is None
    assert cfg.eos_token_ids == [151329, 151336, 151338] and cfg.torch_dtype == torch.bfloat16


def test_minimax_m2_released_config_spelling():
    cfg = ModelConfig.from_dict(MINIMAX_M2_STYLE)
    assert (cfg.model_type, cfg.num_experts, cfg.top_k, cfg.moe_layers) == ("minimax_m2", 256, 8, list(range(62)))
    assert cfg.rotary_dim == 64 and cfg.attention.qk_norm == "full" and cfg.moe_intermediate_size == 1536
    assert (cfg.router.scoring, cfg.router.correction_bias, cfg.router.renormalize, cfg.router.scaling) == ("sigmoid", True, True, 1.0)
    assert cfg.experts.shared_intermediate_size == 0 and cfg.fp8_block == (128, 128)
    with pytest.raises(ConfigError, match="shared experts"):
        ModelConfig.from_dict({**MINIMAX_M2_STYLE, "shared_intermediate_size": 512})


def test_deepseek_v3_released_config_spelling():
    import math

    from r3srv.models.mla import mla_softmax_scale

    cfg = ModelConfig.from_dict(DEEPSEEK_V3_STYLE)
    assert (cfg.model_type, cfg.num_experts, cfg.top_k, cfg.moe_layers) == ("deepseek_v3", 256, 8, list(range(3, 61)))
    assert cfg.is_mla and (cfg.attention.mla.kv_lora_rank, cfg.attention.mla.q_lora_rank, cfg.attention.mla.qk_nope_head_dim, cfg.attention.mla.v_head_dim) == (512, 1536, 128, 128)
    assert cfg.head_dim == cfg.rotary_dim == 64 and cfg.rope.interleave
    assert (cfg.router.num_groups, cfg.router.topk_groups, cfg.router.scaling) == (8, 4, 2.5)
    assert (cfg.router.scoring, cfg.router.correction_bias, cfg.router.float32) == ("sigmoid", True, True)
    assert cfg.experts.shared_intermediate_size == 2048 and not cfg.experts.shared_gate
    assert cfg.rope.yarn["factor"] == 40 and cfg.rope.yarn["original_max_position_embeddings"] == 4096
    assert cfg.fp8_block == (128, 128)
    # one 576-wide latent per token and layer: 61 x 16 x 576 bf16 values a block
    assert cfg.kv_cache_bytes_per_block(16, torch.bfloat16) == 61 * 16 * 576 * 2
    assert mla_softmax_scale(cfg) == pytest.approx(192 ** -0.5 * (0.1 * math.log(40) + 1) ** 2)
    kimi = ModelConfig.from_dict({**DEEPSEEK_V3_STYLE, "n_routed_experts": 384, "n_group": 1, "topk_group": 1,
                                  "first_k_dense_replace": 1, "num_attention_heads": 64,
                                  "num_key_value_heads": 64})
    assert kimi.num_experts == 384 and kimi.moe_layers == list(range(1, 61))
    with pytest.raises(ConfigError, match="noaux_tc"):
        ModelConfig.from_dict({**DEEPSEEK_V3_STYLE, "scoring_func": "softmax", "topk_method": "greedy"})


# DeepSeek-V2-Lite's released config.json spellings: softmax router, no low-rank q, YaRN
DEEPSEEK_V2_LITE_STYLE = {
    "architectures": ["DeepseekV2ForCausalLM"], "first_k_dense_replace": 1, "hidden_size": 2048,
    "intermediate_size": 10944, "kv_lora_rank": 512, "max_position_embeddings": 163840,
    "moe_intermediate_size": 1408, "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64, "n_shared_experts": 2,
    "norm_topk_prob": False, "num_attention_heads": 16, "num_experts_per_tok": 6, "num_hidden_layers": 27,
    "num_key_value_heads": 16, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 1.0, "scoring_func": "softmax", "topk_group": 1,
    "topk_method": "greedy", "torch_dtype": "bfloat16", "v_head_dim": 128, "vocab_size": 102400,
}


def test_deepseek_v2_lite_released_config_spelling():
    cfg = ModelConfig.from_dict(DEEPSEEK_V2_LITE_STYLE)
    assert (cfg.model_type, cfg.num_experts, cfg.top_k, cfg.moe_layers) == ("deepseek_v2", 64, 6, list(range(1, 27)))
    assert cfg.is_mla and cfg.attention.mla.q_lora_rank == 0 and cfg.attention.mla.kv_lora_rank == 512 and cfg.rope.interleave
    assert (cfg.router.scoring, cfg.router.correction_bias, cfg.router.renormalize, cfg.router.num_groups) == ("softmax", False, False, 1)
    assert cfg.experts.shared_intermediate_size == 2 * 1408 and cfg.rope.yarn["mscale_all_dim"] == 0.707
    grouped = ModelConfig.from_dict({**DEEPSEEK_V2_LITE_STYLE, "topk_method": "group_limited_greedy",
                                     "n_group": 8, "topk_group": 3})
    assert (grouped.router.num_groups, grouped.router.topk_groups, grouped.router.group_score_top) == (8, 3, 1)
    for bad in ({"topk_method": "noaux_tc"}, {"scoring_func": "sigmoid"}, {"mlp_bias": True}):
        with pytest.raises(ConfigError, match="DeepseekV2ForCausalLM"):
            ModelConfig.from_dict({**DEEPSEEK_V2_LITE_STYLE, **bad})


# gpt-oss-20b's released config.json spellings (MXFP4 weights: test_models_quantized.py)
GPT_OSS_20B_STYLE = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "eos_token_id": 200002, "experts_per_token": 4,
    "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
    "intermediate_size": 2880, "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4,
    "num_hidden_layers": 24, "num_key_value_heads": 8, "num_local_experts": 32, "pad_token_id": 199999,
    "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                            "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                            "truncate": False},
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
    "rope_theta": 150000, "sliding_window": 128, "swiglu_limit": 7.0, "tie_word_embeddings": False,
    "vocab_size": 201088,
}


def test_gpt_oss_released_config_spelling():
    cfg = ModelConfig.from_dict(GPT_OSS_20B_STYLE)
    assert (cfg.model_type, cfg.num_experts, cfg.top_k, cfg.moe_layers) == ("gpt_oss", 32, 4, list(range(24)))
    assert cfg.attention.sliding_windows == [128, None] * 12 and cfg.attention.sinks
    assert cfg.max_position_embeddings == 131072  # windows run windowed: no cap to the window
    assert cfg.rope.yarn["factor"] == 32.0 and cfg.rope.yarn["truncate"] is False
    assert (cfg.experts.activation, cfg.experts.swiglu_limit, cfg.router.logit_bias, cfg.router.renormalize) == ("clamped_swiglu", 7.0, True, True)
    assert cfg.attention.qkv_bias and cfg.attention.o_bias and cfg.mxfp4 and cfg.fp8_block is None
    with pytest.raises(ConfigError, match="layer_types"):
        ModelConfig.from_dict({**GPT_OSS_20B_STYLE, "layer_types": ["sliding_attention"] * 23})


# ERNIE-4.5-21B-A3B's released config.json spellings
ERNIE_4_5_STYLE = {
    "architectures": ["Ernie4_5_MoeForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 2560, "intermediate_size": 12288, "max_position_embeddings": 131072,
    "model_type": "ernie4_5_moe", "moe_capacity": [64, 64, 64], "moe_gate": "top2_fused", "moe_intermediate_size": 1536,
    "moe_k": 6, "moe_layer_interval": 1, "moe_layer_start_index": 1, "moe_num_experts": 64, "moe_num_shared_experts": 2,
    "moe_use_aux_free": True, "num_attention_heads": 20, "num_hidden_layers": 28, "num_key_value_heads": 4,
    "pad_token_id": 0, "rms_norm_eps": 1e-05, "rope_theta": 500000, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "use_bias": False, "vocab_size": 103424,
}


def test_ernie_4_5_released_config_spelling():
    cfg = ModelConfig.from_dict(ERNIE_4_5_STYLE)
    assert (cfg.model_type, cfg.num_experts, cfg.top_k, cfg.moe_layers) == ("ernie4_5_moe", 64, 6, list(range(1, 28)))
    assert (cfg.router.scoring, cfg.router.correction_bias, cfg.router.float32, cfg.router.renormalize) == ("softmax", True, True, True)
    assert cfg.rope.interleave and cfg.tie_word_embeddings and cfg.rope.theta == 500000
    assert cfg.experts.shared_intermediate_size == 2 * 1536 and not cfg.experts.shared_gate
    with pytest.raises(ConfigError, match="use_bias"):
        ModelConfig.from_dict({**ERNIE_4_5_STYLE, "use_bias": True})


# GLM-4.7-Flash's shape (transformers' Glm4MoeLiteConfig defaults), in DeepSeek-style keys
GLM47_FLASH_STYLE = {
    "architectures": ["Glm4MoeLiteForCausalLM"], "first_k_dense_replace": 1, "hidden_size": 2048,
    "intermediate_size": 10240, "kv_lora_rank": 512, "max_position_embeddings": 202752, "model_type": "glm4_moe_lite",
    "moe_intermediate_size": 1536, "n_group": 1, "n_routed_experts": 64, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 20, "num_experts_per_tok": 4, "num_hidden_layers": 47, "num_key_value_heads": 20,
    "q_lora_rank": 768, "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "rope_theta": 1000000,
    "routed_scaling_factor": 1.8, "topk_group": 1, "torch_dtype": "bfloat16", "v_head_dim": 256, "vocab_size": 154880,
}


def test_glm47_flash_config():
    cfg = ModelConfig.from_dict(GLM47_FLASH_STYLE)
    assert (cfg.model_type, cfg.num_experts, cfg.top_k, cfg.moe_layers) == ("glm4_moe_lite", 64, 4, list(range(1, 47)))
    assert cfg.is_mla and cfg.rotary_dim == 64 and (cfg.router.scoring, cfg.router.correction_bias, cfg.router.scaling) == (
        "sigmoid", True, 1.8)
    kinds = ["dense", "dense"] + ["sparse"] * 45
    assert ModelConfig.from_dict({**GLM47_FLASH_STYLE, "mlp_layer_types": kinds}).moe_layers == list(range(2, 47))
    with pytest.raises(ConfigError, match="mlp_layer_types"):
        ModelConfig.from_dict({**GLM47_FLASH_STYLE, "mlp_layer_types": ["sparse"] * 46})


# dots.llm1's released config.json spellings: every layer full attention (max_window_layers = 62)
DOTS1_STYLE = {
    "architectures": ["Dots1ForCausalLM"], "attention_bias": False, "first_k_dense_replace": 1, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 10944, "max_position_embeddings": 32768,
    "max_window_layers": 62, "model_type": "dots1", "moe_intermediate_size": 1408, "n_group": 1,
    "n_routed_experts": 128, "n_shared_experts": 2, "norm_topk_prob": True, "num_attention_heads": 32,
    "num_experts_per_tok": 6, "num_hidden_layers": 62, "num_key_value_heads": 32, "rms_norm_eps": 1e-05,
    "rope_theta": 10000000, "routed_scaling_factor": 2.5, "sliding_window": 4096, "topk_group": 1,
    "torch_dtype": "bfloat16", "use_sliding_window": False, "vocab_size": 152064,
}


def test_dots1_released_config_spelling():
    cfg = ModelConfig.from_dict(DOTS1_STYLE)
    assert (cfg.model_type, cfg.num_experts, cfg.top_k, cfg.moe_layers) == ("dots1", 128, 6, list(range(1, 62)))
    assert cfg.attention.sliding_windows is None and cfg.max_position_embeddings == 32768  # no layer windowed, no cap
    assert cfg.attention.qk_norm == "head" and cfg.rotary_dim == 128 and cfg.router.renormalize and cfg.router.scaling == 2.5
    windowed = ModelConfig.from_dict({**DOTS1_STYLE, "max_window_layers": 60})
    assert windowed.attention.sliding_windows == [None] * 60 + [4096, 4096]


# The keys of granite-3.1-3b-a800m-instruct's config.json (GraniteMoe: 40 experts, top-8, tied
# embeddings, every muP-style scalar set)
GRANITE_3_MOE_STYLE = {
    "architectures": ["GraniteMoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.1,
    "attention_multiplier": 0.015625, "bos_token_id": 0, "embedding_multiplier": 12.0, "eos_token_id": 0,
    "hidden_act": "silu", "hidden_size": 1536, "intermediate_size": 512, "logits_scaling": 6.0,
    "max_position_embeddings": 131072, "model_type": "granitemoe", "num_attention_heads": 24,
    "num_experts_per_tok": 8, "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 40,
    "residual_multiplier": 0.22, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 10000000.0,
    "router_aux_loss_coef": 0.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "vocab_size": 49155,
}


def test_granite_3_moe_released_config_spelling():
    cfg = ModelConfig.from_dict(GRANITE_3_MOE_STYLE)
    assert (cfg.model_type, cfg.num_experts, cfg.top_k, cfg.moe_intermediate_size) == ("granitemoe", 40, 8, 512)
    assert cfg.moe_layers == list(range(32)) and cfg.rope.enabled and cfg.linear_attention_layers == []
    assert (cfg.scales.embedding, cfg.scales.residual, cfg.scales.logits, cfg.attention.scale) == (
        12.0, 0.22, 6.0, 0.015625)
    assert cfg.router.renormalize and cfg.experts.shared_intermediate_size == 0 and cfg.tie_word_embeddings
    shared = ModelConfig.from_dict({**GRANITE_3_MOE_STYLE, "architectures": ["GraniteMoeSharedForCausalLM"],
                                    "model_type": "granitemoeshared", "shared_intermediate_size": 1024})
    assert shared.model_type == "granitemoeshared" and shared.experts.shared_intermediate_size == 1024
    assert not shared.experts.shared_gate
    # transformers' defaults where a config leaves a scalar out
    bare = ModelConfig.from_dict({k: v for k, v in GRANITE_3_MOE_STYLE.items() if "multiplier" not in k})
    assert (bare.scales.embedding, bare.scales.residual, bare.attention.scale) == (1.0, 1.0, 1.0)


# Qwen3-VL-30B-A3B-Instruct's config.json: the language model in text_config, M-RoPE in
# rope_scaling, untied embeddings said by the outer config
QWEN3_VL_30B = {
    "architectures": ["Qwen3VLMoeForConditionalGeneration"], "model_type": "qwen3_vl_moe", "tie_word_embeddings": False,
    "image_token_id": 151655, "video_token_id": 151656,
    "text_config": {
        "attention_bias": False, "decoder_sparse_step": 1, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
        "intermediate_size": 6144, "max_position_embeddings": 262144, "mlp_only_layers": [],
        "model_type": "qwen3_vl_moe_text", "moe_intermediate_size": 768, "norm_topk_prob": True,
        "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
        "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 5000000, "vocab_size": 151936,
        "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"},
    },
    "vision_config": {"depth": 27, "hidden_size": 1152, "model_type": "qwen3_vl_moe", "out_hidden_size": 2048},
}


def test_qwen3_vl_moe_released_config_spelling():
    cfg = ModelConfig.from_dict(QWEN3_VL_30B)
    assert (cfg.model_type, cfg.num_layers, cfg.num_experts, cfg.top_k, cfg.moe_intermediate_size) == (
        "qwen3_vl_moe", 48, 128, 8, 768)
    assert cfg.head_dim == 128 and cfg.rope.theta == 5000000 and cfg.attention.qk_norm == "head" and cfg.router.renormalize
    assert not cfg.tie_word_embeddings and cfg.moe_layers == list(range(48)) and cfg.rotary_dim == 128
    # the outer config says whether lm_head is the embedding, whatever text_config says
    tied_inside = {**QWEN3_VL_30B, "text_config": {**QWEN3_VL_30B["text_config"], "tie_word_embeddings": True}}
    assert not ModelConfig.from_dict(tied_inside).tie_word_embeddings


def test_qwen3_vl_moe_released_expert_layout_loads_as_transformers_saved_one(tmp_path, caplog):
    """Released Qwen3-VL checkpoints store the fused experts transposed ([E, H, 2I], [E, I, H]);
    transformers 5 saves them as it holds them. Both load to the same model; the vision tower's
    tensors are left out (and said so)."""
    saved = write_tiny_checkpoint(tmp_path / "saved", "qwen3_vl_moe", seed=6)
    released = tmp_path / "released"
    shutil.copytree(saved, released)
    tensors = load_file(str(saved / "model.safetensors"))
    experts = [k for k in tensors if k.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))]
    assert experts and any(k.startswith("model.visual.") for k in tensors)
    save_file({k: v.transpose(1, 2).contiguous() if k in experts else v for k, v in tensors.items()},
              str(released / "model.safetensors"))
    want_logits, want_rows = prefill(load_model(saved)[0], PROMPT)
    logits, rows = prefill(load_model(released)[0], PROMPT)
    assert torch.equal(logits, want_logits) and torch.equal(rows, want_rows)
    assert "model.visual." in caplog.text


def test_glm4v_moe_default_config_is_glm_4_5v_shaped():
    """transformers' Glm4vMoeConfig defaults are GLM-4.5V's shape (its docstring's checkpoint),
    46 layers, the first dense, 128 experts top-8 under the sigmoid router, biased qkv, half the
    head rotated (M-RoPE sections over those 64 dims)."""
    transformers = pytest.importorskip("transformers")
    raw = transformers.Glm4vMoeConfig().to_dict()
    raw["architectures"] = ["Glm4vMoeForConditionalGeneration"]
    raw["text_config"]["head_dim"] = 128  # the released config says it (GLM-4.5-Air's); 4096 / 96 is not whole
    cfg = ModelConfig.from_dict(raw)
    assert (cfg.model_type, cfg.num_layers, cfg.num_experts, cfg.top_k, cfg.moe_layers) == (
        "glm4v_moe", 46, 128, 8, list(range(1, 46)))
    assert cfg.rotary_dim == 64 and cfg.attention.qkv_bias and cfg.attention.qk_norm is None
    assert cfg.router.scoring == "sigmoid" and cfg.router.correction_bias and cfg.router.renormalize
    assert cfg.experts.shared_intermediate_size == cfg.moe_intermediate_size == 1408


@pytest.mark.parametrize(
    "groups,match",
    [({"n_group": 3}, "must divide"), ({"n_group": 2, "topk_group": 3}, "topk_group"),
     ({"n_group": 32, "topk_group": 1}, "exceeds")],
)
def test_bad_expert_groups_are_config_errors(groups, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_dict({**GLM45_AIR_STYLE, **groups})


def test_odd_rotary_width_is_a_config_error():
    with pytest.raises(ConfigError, match="rotary dims"):
        ModelConfig.from_dict({**GLM45_AIR_STYLE, "partial_rotary_factor": 0.7})


def test_bfloat16_model_keeps_the_router_in_float32(tmp_path):
    """A bf16 checkpoint stores the correction bias in float32 (transformers keeps it so);
    rounding it, or the router logits, to bf16 would change which experts win."""
    path = write_tiny_checkpoint(tmp_path / "fp32", "glm4_moe", seed=3)
    tensors = load_file(str(path / "model.safetensors"))
    bf16 = {k: v if k.endswith("e_score_correction_bias") else v.to(torch.bfloat16) for k, v in tensors.items()}
    save_file(bf16, str(path / "model.safetensors"))
    raw = json.loads((path / "config.json").read_text())
    raw["dtype"] = "bfloat16"
    (path / "config.json").write_text(json.dumps(raw))

    model, _ = load_model(path, dtype="bfloat16")
    moe = model.layers[0].mlp
    assert model.embed.weight.dtype == torch.bfloat16 and moe.experts.w13.dtype == torch.bfloat16
    assert moe.gate.dtype == torch.float32 and moe.correction_bias.dtype == torch.float32
    bias = tensors["model.layers.0.mlp.gate.e_score_correction_bias"]
    assert torch.equal(moe.correction_bias, bias)  # bit for bit, not via bf16
    assert torch.equal(moe.gate, bf16["model.layers.0.mlp.gate.weight"].float())
    logits, rows = prefill(model, PROMPT)
    assert torch.isfinite(logits).all()
    assert all(len(set(r)) == model.config.top_k for r in rows.reshape(-1, model.config.top_k).tolist())


def test_the_mtp_layer_of_a_released_checkpoint_is_ignored(tmp_path, caplog):
    """Released GLM-4.5 checkpoints carry one multi-token-prediction layer after the last
    decoder layer (model.layers.<num_hidden_layers>.*); serving does not use it."""
    plain = write_tiny_checkpoint(tmp_path / "plain", "glm4_moe", seed=4)
    with_mtp = tmp_path / "with_mtp"
    shutil.copytree(plain, with_mtp)
    tensors = load_file(str(with_mtp / "model.safetensors"))
    n = ModelConfig.from_dir(plain).num_layers
    layer0 = "model.layers.0."
    extra = {f"model.layers.{n}." + k.removeprefix(layer0): v.clone() for k, v in tensors.items() if k.startswith(layer0)}
    extra[f"model.layers.{n}.eh_proj.weight"] = torch.randn(32, 64)
    save_file({**tensors, **extra}, str(with_mtp / "model.safetensors"))

    want_logits, want_rows = prefill(load_model(plain)[0], PROMPT)
    logits, rows = prefill(load_model(with_mtp)[0], PROMPT)
    assert torch.equal(logits, want_logits) and torch.equal(rows, want_rows)
    assert f"model.layers.{n}." in caplog.text  # named in the "ignored" warning


# Arcee Trinity-Mini's shape in AfmoeConfig's spellings: a global layer every 4th, muP input scaling
AFMOE_TRINITY_MINI = {
    "architectures": ["AfmoeForCausalLM"], "model_type": "afmoe", "hidden_size": 2048, "intermediate_size": 6144,
    "moe_intermediate_size": 1024, "num_hidden_layers": 32, "num_dense_layers": 2, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "num_shared_experts": 1,
    "route_scale": 2.826, "global_attn_every_n_layers": 4, "sliding_window": 2048, "mup_enabled": True,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "vocab_size": 200192, "torch_dtype": "bfloat16",
    "rope_parameters": {"rope_theta": 10000, "rope_type": "default"},
}


def test_afmoe_config_spelling():
    cfg = ModelConfig.from_dict(AFMOE_TRINITY_MINI)
    assert cfg.model_type == "afmoe" and cfg.norm.sandwich and cfg.attention.gate_proj and cfg.norm.weight_float32
    full = [i for i in range(32) if cfg.attention.sliding_windows[i] is None]
    assert full == [3, 7, 11, 15, 19, 23, 27, 31] and cfg.rope.layers == [i for i in range(32) if i not in full]
    assert cfg.moe_layers == list(range(2, 32)) and cfg.router.scaling == 2.826 and cfg.router.correction_bias
    assert cfg.scales.embedding == 2048**0.5 and cfg.experts.shared_intermediate_size == 1024


def test_granite_swa_config_spellings():
    """GraniteMoeSWA as transformers 5.23's GraniteMoeSWAConfig writes it (no released config.json
    was at hand): its defaults (a window of 128, every fourth layer full from the first) apply
    where the keys are missing; a 0 in layer_rope_theta is a layer without positions; several
    RoPE bases and a list of the wrong length are refused."""
    transformers = pytest.importorskip("transformers")
    written = transformers.GraniteMoeSWAConfig(num_hidden_layers=8, layer_rope_theta=[0.0, 5e5, 5e5, 5e5] * 2,
                                               shared_intermediate_size=64).to_dict()
    written["architectures"] = ["GraniteMoeSWAForCausalLM"]
    cfg = ModelConfig.from_dict(written)
    assert cfg.model_type == "granitemoe_swa" and cfg.attention.sinks and cfg.experts.shared_intermediate_size == 64
    assert cfg.attention.sliding_windows == [None, 128, 128, 128] * 2
    assert cfg.rope.layers == [1, 2, 3, 5, 6, 7] and cfg.rope.theta == 5e5
    bare = {k: v for k, v in written.items() if k not in ("layer_types", "sliding_window", "layer_rope_theta")}
    cfg = ModelConfig.from_dict(bare)
    assert cfg.attention.sliding_windows == [None, 128, 128, 128] * 2 and cfg.rope.layers is None
    with pytest.raises(ConfigError, match="several RoPE bases"):
        ModelConfig.from_dict({**written, "layer_rope_theta": [0.0, 1e4, 5e5, 5e5] * 2})
    with pytest.raises(ConfigError, match="layer_rope_theta has 3 entries"):
        ModelConfig.from_dict({**written, "layer_rope_theta": [0.0, 1e4, 1e4]})


def test_flex_olmo_config_spellings():
    """FlexOlmo as transformers 5.23's FlexOlmoConfig writes it (its defaults: 7 experts, top-5,
    no renormalisation; no released config.json was at hand): OLMoE's router and full-width
    q/k norms, no norm before a branch and one on each branch's output."""
    transformers = pytest.importorskip("transformers")
    written = transformers.FlexOlmoConfig(num_hidden_layers=4).to_dict()
    written["architectures"] = ["FlexOlmoForCausalLM"]
    cfg = ModelConfig.from_dict(written)
    assert (cfg.model_type, cfg.num_experts, cfg.top_k, cfg.router.renormalize) == ("flex_olmo", 7, 5, False)
    assert cfg.attention.qk_norm == "full" and cfg.attention.clip_qkv is None and not cfg.norm.pre and cfg.norm.sandwich
    assert cfg.moe_layers == [0, 1, 2, 3] and cfg.rope.theta == 500000.0 and cfg.num_kv_heads == 32
