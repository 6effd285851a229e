"""Hybrid models (Qwen3-Next, Qwen3.5-MoE, Nemotron-H, Kimi-Linear, Granite-4.0-H, LFM2-MoE) beyond the transformers oracle tests: their
released config.json spellings, sizes that follow from them, and Qwen3.5's multimodal
checkpoint layout (a nested text_config, model.language_model.* names, vision and MTP
tensors the server does not use)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from r3srv.models.config import ModelConfig
from r3srv.models.loader import load_model
from model_testing import prefill
from tiny_checkpoints import write_tiny_checkpoint

pytest.importorskip("transformers")

# Qwen3-Next-80B-A3B-Instruct's config.json (transformers 4.57 era): top-level rope_theta and
# partial_rotary_factor, layer kinds by full_attention_interval, 512 experts, top-10
QWEN3_NEXT_80B = {
    "architectures": ["Qwen3NextForCausalLM"], "attention_bias": False, "bos_token_id": 151643,
    "decoder_sparse_step": 1, "eos_token_id": 151645, "full_attention_interval": 4, "head_dim": 256,
    "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 5120, "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "linear_value_head_dim": 128, "max_position_embeddings": 262144, "mlp_only_layers": [],
    "model_type": "qwen3_next", "moe_intermediate_size": 512, "norm_topk_prob": True, "num_attention_heads": 16,
    "num_experts": 512, "num_experts_per_tok": 10, "num_hidden_layers": 48, "num_key_value_heads": 2,
    "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 10000000,
    "shared_expert_intermediate_size": 512, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "use_sliding_window": False, "vocab_size": 151936,
}

# Qwen3.5-35B-A3B's config.json: the language model in text_config (with M-RoPE parameters and
# an MTP layer), a vision tower beside it
QWEN35_35B = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
    "image_token_id": 248056, "video_token_id": 248057, "tie_word_embeddings": False,
    "text_config": {
        "attention_bias": False, "attn_output_gate": True, "dtype": "bfloat16", "eos_token_id": 248044,
        "full_attention_interval": 4, "head_dim": 256, "hidden_act": "silu", "hidden_size": 2048,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 10,
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16,
        "linear_num_value_heads": 32, "linear_value_head_dim": 128, "max_position_embeddings": 262144,
        "model_type": "qwen3_5_moe_text", "moe_intermediate_size": 512, "mtp_num_hidden_layers": 1,
        "num_attention_heads": 16, "num_experts": 256, "num_experts_per_tok": 8, "num_hidden_layers": 40,
        "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "shared_expert_intermediate_size": 512,
        "vocab_size": 248320,
        "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "rope_type": "default",
                            "rope_theta": 10000000, "partial_rotary_factor": 0.25},
    },
    "vision_config": {"depth": 27, "hidden_size": 1152, "model_type": "qwen3_5_moe", "out_hidden_size": 2048},
}


def test_qwen3_next_released_config_spelling():
    cfg = ModelConfig.from_dict(QWEN3_NEXT_80B)
    assert cfg.model_type == "qwen3_next" and cfg.is_hybrid
    assert cfg.attention_layers == [3, 7, 11, 15, 19, 23, 27, 31, 35, 39, 43, 47]
    assert len(cfg.linear_attention_layers) == 36 and cfg.moe_layers == list(range(48))
    assert (cfg.num_experts, cfg.top_k, cfg.experts.shared_intermediate_size) == (512, 10, 512)
    assert cfg.router.renormalize and cfg.experts.shared_gate and cfg.norm.zero_centered and cfg.attention.output_gate
    assert cfg.rotary_dim == 64 and cfg.rope.theta == 1e7 and cfg.torch_dtype == torch.bfloat16
    assert cfg.linear.projection_layout == "qkvz_ba"
    # K/V for the 12 attention layers only; per sequence, 36 x (conv window + float32 matrix)
    assert cfg.kv_cache_bytes_per_block(16, torch.bfloat16) == 2 * 12 * 16 * 2 * 256 * 2
    assert cfg.linear_state_bytes(torch.bfloat16) == 36 * ((2 * 16 * 128 + 32 * 128) * 3 * 2 + 32 * 128 * 128 * 4)


def test_qwen3_5_released_config_spelling():
    cfg = ModelConfig.from_dict(QWEN35_35B)
    assert cfg.architecture == "Qwen3_5MoeForConditionalGeneration" and cfg.model_type == "qwen3_5_moe"
    assert cfg.num_layers == 40 and cfg.moe_layers == list(range(40)) and cfg.router.renormalize
    assert cfg.attention_layers == list(range(3, 40, 4)) and cfg.vocab_size == 248320
    assert cfg.rotary_dim == 64 and cfg.rope.yarn is None and cfg.torch_dtype == torch.bfloat16
    assert cfg.linear.projection_layout == "qkv_z_b_a" and cfg.eos_token_ids == [248044]
    no_gate = json.loads(json.dumps(QWEN35_35B))
    no_gate["text_config"]["attn_output_gate"] = False
    assert not ModelConfig.from_dict(no_gate).attention.output_gate


def test_qwen3_5_multimodal_checkpoint_serves_its_language_model(tmp_path, caplog):
    """The tiny Qwen3_5MoeForCausalLM rewritten as the released checkpoints are laid out: the
    same weights under model.language_model.*, a vision tower and an MTP layer beside them."""
    plain = write_tiny_checkpoint(tmp_path / "plain", "qwen3_5_moe", seed=6)
    released = tmp_path / "released"
    shutil.copytree(plain, released)
    text_config = json.loads((plain / "config.json").read_text())
    config = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
              "tie_word_embeddings": False, "text_config": text_config, "image_token_id": 7,
              "vision_config": {"depth": 1, "hidden_size": 16, "model_type": "qwen3_5_moe"}}
    (released / "config.json").write_text(json.dumps(config))
    tensors = {("model.language_model." + k.removeprefix("model.") if k.startswith("model.") else k): v
               for k, v in load_file(str(plain / "model.safetensors")).items()}
    tensors["model.visual.blocks.0.attn.qkv.weight"] = torch.randn(48, 16)
    tensors["mtp.fc.weight"] = torch.randn(32, 64)
    save_file(tensors, str(released / "model.safetensors"))

    want_logits, want_rows = prefill(load_model(plain)[0], list(range(30, 50)))
    model, _ = load_model(released)
    logits, rows = prefill(model, list(range(30, 50)))
    assert torch.equal(logits, want_logits) and torch.equal(rows, want_rows)
    assert "model.visual.blocks.0.attn.qkv.weight" in caplog.text and "mtp.fc.weight" in caplog.text


# NVIDIA Nemotron 3 Nano 30B-A3B's config.json (remote-code era spellings): the layer pattern as
# letters (M Mamba-2, E MoE, * attention), norm epsilon as layer_norm_epsilon, an unused rope_theta
NEMOTRON3_NANO = {
    "architectures": ["NemotronHForCausalLM"], "attention_bias": False, "bos_token_id": 1, "chunk_size": 128,
    "conv_kernel": 4, "eos_token_id": 2, "expand": 2, "head_dim": 128, "hidden_size": 2688,
    "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME", "intermediate_size": 1856,
    "layer_norm_epsilon": 1e-05, "mamba_head_dim": 64, "mamba_hidden_act": "silu", "mamba_num_heads": 64,
    "mamba_proj_bias": False, "max_position_embeddings": 262144, "mlp_bias": False, "mlp_hidden_act": "relu2",
    "model_type": "nemotron_h", "moe_intermediate_size": 1856, "moe_shared_expert_intermediate_size": 3712,
    "n_group": 1, "n_groups": 8, "n_routed_experts": 128, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 32, "num_experts_per_tok": 6, "num_hidden_layers": 52, "num_key_value_heads": 2,
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "sliding_window": None, "ssm_state_size": 128,
    "tie_word_embeddings": False, "time_step_limit": [0.0, float("inf")], "time_step_min": 0.001, "topk_group": 1,
    "torch_dtype": "bfloat16", "use_bias": False, "use_conv_bias": True, "vocab_size": 131072,
}


def test_nemotron_h_released_config_spelling():
    cfg = ModelConfig.from_dict(NEMOTRON3_NANO)
    assert cfg.model_type == "nemotron_h" and cfg.is_hybrid and not cfg.rope.enabled
    assert cfg.num_layers == 52 and cfg.layer_kinds[:6] == ["mamba", "moe", "mamba", "moe", "mamba", "attention"]
    assert len(cfg.linear_attention_layers) == 23 and len(cfg.moe_layers) == 23 and len(cfg.attention_layers) == 6
    assert (cfg.num_experts, cfg.top_k, cfg.experts.shared_intermediate_size) == (128, 6, 3712)
    assert cfg.experts.activation == "relu2" and cfg.router.scoring == "sigmoid" and cfg.router.correction_bias and cfg.router.renormalize
    assert cfg.router.scaling == 2.5 and cfg.norm.eps == 1e-5 and cfg.linear.groups == 8
    assert cfg.kv_cache_bytes_per_block(16, torch.bfloat16) == 6 * 2 * 16 * 2 * 128 * 2
    conv = (64 * 64 + 2 * 8 * 128) * 3 * 2
    assert cfg.linear_state_bytes(torch.bfloat16) == 23 * (conv + 64 * 64 * 128 * 4)
    listed = {**NEMOTRON3_NANO, "layers_block_type": ["mamba", "moe", "attention", "mlp"]}
    del listed["hybrid_override_pattern"]
    assert ModelConfig.from_dict(listed).layer_kinds == ["mamba", "moe", "attention", "mlp"]


@pytest.mark.parametrize("change, match", [
    ({"mlp_hidden_act": "gelu"}, "mlp_hidden_act"),
    ({"moe_latent_size": 1024}, "moe_latent_size"),
    ({"hybrid_override_pattern": "MEX"}, "layer kinds"),
])
def test_unsupported_nemotron_h_configs_are_config_errors(change, match):
    from r3srv.errors import ConfigError

    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_dict({**NEMOTRON3_NANO, **change})


# Kimi-Linear-48B-A3B's shape in its config.json spellings: Moonshot's names for DeepSeek's keys,
# the layer kinds in linear_attn_config (1-indexed), no q_lora_rank
KIMI_LINEAR = {
    "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "hidden_size": 2304,
    "intermediate_size": 9216, "moe_intermediate_size": 1024, "num_hidden_layers": 27, "num_attention_heads": 32,
    "num_key_value_heads": 32, "num_experts": 256, "num_experts_per_token": 8, "num_shared_experts": 1,
    "num_expert_group": 1, "topk_group": 1, "moe_renormalize": True, "moe_router_activation_func": "sigmoid",
    "routed_scaling_factor": 2.446, "first_k_dense_replace": 1, "kv_lora_rank": 512, "q_lora_rank": None,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "mla_use_nope": True,
    "model_max_length": 1048576, "rms_norm_eps": 1e-05, "vocab_size": 163840, "torch_dtype": "bfloat16",
    "linear_attn_config": {"full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
                           "kda_layers": [i for i in range(1, 28) if i not in (4, 8, 12, 16, 20, 24, 27)],
                           "head_dim": 128, "num_heads": 32, "short_conv_kernel_size": 4},
}


def test_kimi_linear_released_config_spelling():
    cfg = ModelConfig.from_dict(KIMI_LINEAR)
    assert cfg.model_type == "kimi_linear" and cfg.is_hybrid and cfg.is_mla and not cfg.rope.enabled
    assert cfg.linear.kind == "kda" and cfg.attention_layers == [3, 7, 11, 15, 19, 23, 26]
    assert (cfg.num_experts, cfg.top_k, cfg.router.renormalize, cfg.max_position_embeddings) == (256, 8, True, 1048576)
    assert cfg.moe_layers == list(range(1, 27)) and cfg.experts.shared_intermediate_size == 1024
    assert (cfg.linear.num_value_heads, cfg.linear.value_head_dim, cfg.linear.conv_kernel) == (32, 128, 4)
    assert cfg.kv_cache_bytes_per_block(16, torch.bfloat16) == 7 * (512 + 64) * 16 * 2  # MLA layers only
    assert cfg.linear_state_bytes(torch.bfloat16) == 20 * (3 * 32 * 128 * 3 * 2 + 32 * 128 * 128 * 4)
    from r3srv.errors import ConfigError

    with pytest.raises(ConfigError, match="moe_router_activation_func"):
        ModelConfig.from_dict({**KIMI_LINEAR, "moe_router_activation_func": "softmax"})


# Granite-4.0-H-Small's shape in its config.json spellings: the older layer kind names, an
# infinite time_step_limit, no positions, muP-style scalars, top-10 of 72 experts
GRANITE4_H_SMALL = {
    "architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid", "hidden_size": 4096,
    "num_hidden_layers": 40, "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 768,
    "shared_intermediate_size": 8192, "num_local_experts": 72, "num_experts_per_tok": 10, "mamba_n_heads": 128,
    "mamba_d_head": 64, "mamba_d_state": 128, "mamba_n_groups": 1, "mamba_expand": 2, "mamba_d_conv": 4,
    "mamba_conv_bias": True, "mamba_proj_bias": False, "position_embedding_type": "nope",
    "time_step_limit": [0.0, float("inf")], "attention_multiplier": 0.0078125, "embedding_multiplier": 12,
    "residual_multiplier": 0.22, "logits_scaling": 8, "rms_norm_eps": 1e-05, "vocab_size": 100352,
    "max_position_embeddings": 131072, "torch_dtype": "bfloat16", "tie_word_embeddings": True,
    "layer_types": ["attention" if i in (5, 15, 25, 35) else "mamba" for i in range(40)],
}


def test_granite_4_h_released_config_spelling():
    cfg = ModelConfig.from_dict(GRANITE4_H_SMALL)
    assert cfg.model_type == "granitemoehybrid" and cfg.linear.kind == "mamba2" and not cfg.rope.enabled
    assert cfg.attention_layers == [5, 15, 25, 35] and len(cfg.linear_attention_layers) == 36
    assert (cfg.num_experts, cfg.top_k, cfg.moe_intermediate_size, cfg.experts.shared_intermediate_size) == (72, 10, 768, 8192)
    assert cfg.router.scoring == "softmax" and cfg.router.renormalize and not cfg.experts.shared_gate and cfg.tie_word_embeddings
    assert (cfg.scales.embedding, cfg.scales.residual, cfg.scales.logits, cfg.attention.scale) == (12, 0.22, 8, 0.0078125)
    assert cfg.linear.dt_min == 0.0 and cfg.moe_layers == list(range(40))
    conv = (128 * 64 + 2 * 1 * 128) * 3 * 2
    assert cfg.linear_state_bytes(torch.bfloat16) == 36 * (conv + 128 * 64 * 128 * 4)
    from r3srv.errors import ConfigError

    with pytest.raises(ConfigError, match="mamba_expand"):
        ModelConfig.from_dict({**GRANITE4_H_SMALL, "mamba_expand": 3})


# LFM2-8B-A1B's config.json keys and spellings (norm_eps, tie_embedding, conv_L_cache): 24
# layers, of which 6 attention
LFM2_8B_A1B = {
    "architectures": ["Lfm2MoeForCausalLM"], "model_type": "lfm2_moe", "hidden_size": 2048, "intermediate_size": 7168,
    "moe_intermediate_size": 1792, "num_hidden_layers": 24, "num_attention_heads": 32, "num_key_value_heads": 8,
    "num_dense_layers": 2, "num_experts": 32, "num_experts_per_tok": 4, "norm_topk_prob": True,
    "use_expert_bias": True, "routed_scaling_factor": 1.0, "conv_L_cache": 3, "conv_bias": False,
    "norm_eps": 1e-05, "rope_theta": 1000000.0, "max_position_embeddings": 128000, "tie_embedding": True,
    "vocab_size": 65536, "dtype": "bfloat16",
    "layer_types": ["full_attention" if i in (2, 6, 10, 14, 18, 21) else "conv" for i in range(24)],
}


def test_lfm2_moe_released_config_spelling():
    cfg = ModelConfig.from_dict(LFM2_8B_A1B)
    assert cfg.model_type == "lfm2_moe" and cfg.linear.kind == "short_conv" and cfg.rope.enabled
    assert cfg.attention_layers == [2, 6, 10, 14, 18, 21] and len(cfg.linear_attention_layers) == 18
    assert (cfg.num_experts, cfg.top_k, cfg.moe_intermediate_size, cfg.moe_layers) == (32, 4, 1792, list(range(2, 24)))
    assert cfg.router.scoring == "sigmoid" and cfg.router.correction_bias and cfg.router.renormalize and cfg.attention.qk_norm == "head"
    assert cfg.norm.eps == 1e-05 and cfg.tie_word_embeddings and cfg.linear.conv_kernel == 3
    assert cfg.linear_state_bytes(torch.bfloat16) == 18 * 2048 * 2 * 2  # the conv window alone: 2 inputs
    from r3srv.errors import ConfigError

    with pytest.raises(ConfigError, match="layer_types"):
        ModelConfig.from_dict({**LFM2_8B_A1B, "layer_types": ["conv"] * 23})
