"""Tiny random Hugging Face checkpoints, one per supported family, for tests.

Written with transformers' own config and model classes (`save_pretrained`, safetensors),
so the loader reads exactly what a real checkpoint of the family looks like; the
byte-level tokenizer of the built-in model is written next to them, so text prompts work.

    from tiny_checkpoints import write_tiny_checkpoint
    path = write_tiny_checkpoint(tmp_path / "ckpt", "mixtral", num_experts=16)

Weights are re-drawn with a wide spread (transformers' std-0.02 init makes router scores
near-ties, so tiny float differences would flip the top-k): every family's routing and
greedy tokens are then well separated and comparable across implementations.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from r3srv.models.builtin import SPECIAL_TOKENS, write_byte_level_tokenizer

FAMILIES = (
    "qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "glm4_moe", "minimax_m2", "deepseek_v3", "deepseek_v2", "gpt_oss",
    "ernie4_5_moe", "glm4_moe_lite", "dots1", "qwen3_next", "qwen3_5_moe", "deepseek_v32", "glm_moe_dsa", "nemotron_h",
    "kimi_linear", "granitemoehybrid", "afmoe", "granitemoe", "granitemoeshared", "lfm2_moe", "qwen3_vl_moe",
    "granitemoe_swa", "flex_olmo",
)
VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)  # the byte-level tokenizer
EOS_TOKEN_ID = 256 + SPECIAL_TOKENS.index("<|im_end|>")


def hf_config(family: str, *, num_experts: int = 8, top_k: int = 2, num_layers: int = 2, **overrides: Any):
    """A tiny transformers config object of `family`; `overrides` go straight into it."""
    import transformers

    common = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=32,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts_per_tok=top_k,
        max_position_embeddings=512,
        eos_token_id=EOS_TOKEN_ID,
        bos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    if family == "qwen3_moe":
        cls, extra = transformers.Qwen3MoeConfig, dict(
            num_experts=num_experts, intermediate_size=48, moe_intermediate_size=16, head_dim=16, norm_topk_prob=True
        )
    elif family == "qwen2_moe":
        cls, extra = transformers.Qwen2MoeConfig, dict(
            num_experts=num_experts, intermediate_size=48, moe_intermediate_size=16, shared_expert_intermediate_size=24
        )
    elif family == "mixtral":
        cls, extra = transformers.MixtralConfig, dict(num_local_experts=num_experts, intermediate_size=16)
    elif family == "olmoe":
        cls, extra = transformers.OlmoeConfig, dict(num_experts=num_experts, intermediate_size=16, clip_qkv=3.0)
    elif family == "flex_olmo":
        # FlexOlmo: OLMoE's router and q/k norms in OLMo-2's layout (only branch outputs normalised)
        cls, extra = transformers.FlexOlmoConfig, dict(num_experts=num_experts, intermediate_size=16)
    elif family == "glm4_moe":
        # GLM-4.6's switches: biased qkv, routed_scaling_factor 2.5, one shared expert, and
        # (transformers' default) partial rotary 0.5; all layers MoE unless overridden
        cls, extra = transformers.Glm4MoeConfig, dict(
            n_routed_experts=num_experts, intermediate_size=48, moe_intermediate_size=16, head_dim=16,
            first_k_dense_replace=0, attention_bias=True, routed_scaling_factor=2.5, n_shared_experts=1,
        )
    elif family == "minimax_m2":
        # rotary_dim as the released configs spell partial RoPE (half of head_dim here)
        cls, extra = transformers.MiniMaxM2Config, dict(
            num_local_experts=num_experts, intermediate_size=16, head_dim=16, rotary_dim=8
        )
    elif family == "deepseek_v3":
        # MLA with a low-rank q; every attention width differs, so a mix-up cannot go unnoticed
        cls, extra = transformers.DeepseekV3Config, dict(
            n_routed_experts=num_experts, intermediate_size=48, moe_intermediate_size=16, num_key_value_heads=4,
            q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10,
            n_group=1, topk_group=1, first_k_dense_replace=0, n_shared_experts=1, routed_scaling_factor=2.5,
        )
    elif family == "deepseek_v2":
        # V2-Lite's shape: no low-rank q, two shared experts, softmax routing scaled
        cls, extra = transformers.DeepseekV2Config, dict(
            n_routed_experts=num_experts, intermediate_size=48, moe_intermediate_size=16, num_key_value_heads=4,
            q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10,
            first_k_dense_replace=0, n_shared_experts=2, routed_scaling_factor=1.5,
        )
    elif family == "gpt_oss":
        # a window of 4 (every other layer) that prompts and decodes run past; transformers'
        # default YaRN (factor 32) scaled to the tiny context
        cls, extra = transformers.GptOssConfig, dict(
            num_local_experts=num_experts, intermediate_size=16, head_dim=8, sliding_window=4,
            rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                             "beta_slow": 1.0, "original_max_position_embeddings": 16, "truncate": False},
        )
    elif family == "glm4_moe_lite":
        # GLM-4.7-Flash: MLA (no partial rotary) with GLM's router; all layers MoE unless overridden
        cls, extra = transformers.Glm4MoeLiteConfig, dict(
            n_routed_experts=num_experts, intermediate_size=48, moe_intermediate_size=16, num_key_value_heads=4,
            q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10,
            mlp_layer_types=["sparse"] * num_layers, routed_scaling_factor=1.8,
        )
    elif family == "dots1":
        # dots.llm1: a window of 4 on the last layer (max_window_layers), one shared expert
        cls, extra = transformers.Dots1Config, dict(
            n_routed_experts=num_experts, intermediate_size=48, moe_intermediate_size=16, head_dim=16,
            n_shared_experts=1, routed_scaling_factor=2.0, sliding_window=4, max_window_layers=num_layers - 1,
            norm_topk_prob=True,
        )
    elif family == "ernie4_5_moe":
        # every layer MoE unless overridden; untied embeddings like the other tiny checkpoints
        cls, extra = transformers.Ernie4_5_MoeConfig, dict(
            moe_num_experts=num_experts, moe_k=top_k, intermediate_size=48, moe_intermediate_size=16, head_dim=16,
            moe_layer_start_index=0, moe_num_shared_experts=1,
        )
    elif family in ("deepseek_v32", "glm_moe_dsa"):
        # DeepSeek-V3 with sparse attention: each query attends to its indexer's 5 best keys, so
        # prompts and decodes past 5 tokens attend sparsely; GLM-5's second layer shares the first's choice.
        # 16 indexer heads: with 4, one key in 16 scores exactly 0 (relu in every head), and
        # torch.topk breaks such ties differently on the CPU and CUDA (seen on an H200)
        dsa = dict(
            n_routed_experts=num_experts, intermediate_size=48, moe_intermediate_size=16, num_key_value_heads=4,
            q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10,
            n_group=1, topk_group=1, first_k_dense_replace=0, n_shared_experts=1, routed_scaling_factor=2.5,
            index_topk=5, index_n_heads=16, index_head_dim=16,
        )
        if family == "deepseek_v32":
            cls, extra = transformers.DeepseekV32Config, dsa
        else:
            cls, extra = transformers.GlmMoeDsaConfig, dict(dsa, indexer_types=["full"] + ["shared"] * (num_layers - 1))
    elif family == "afmoe":
        # Arcee's AFMoE: a window of 4 on the first layer (with RoPE), full attention without
        # positions on the second, sandwich norms, gated attention output, muP input scaling
        cls, extra = transformers.AfmoeConfig, dict(
            num_experts=num_experts, intermediate_size=48, moe_intermediate_size=16, head_dim=16, num_dense_layers=0,
            num_shared_experts=1, route_scale=2.0, sliding_window=4, global_attn_every_n_layers=2, mup_enabled=True,
        )
    elif family == "granitemoehybrid":
        # Granite-4.0-H: Mamba-2 and attention without positions, a shared MLP beside the experts,
        # every muP-style scalar away from 1 so that a forgotten one shows
        cls, extra = transformers.GraniteMoeHybridConfig, dict(
            num_local_experts=num_experts, intermediate_size=16, shared_intermediate_size=24, mamba_n_heads=4,
            mamba_d_head=16, mamba_d_state=8, mamba_n_groups=2, mamba_expand=2, position_embedding_type="nope",
            layer_types=["attention" if i % 2 else "mamba" for i in range(num_layers)],
            embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=3.0,
        )
    elif family in ("granitemoe", "granitemoeshared"):
        # Granite 3.x MoE (and its shared-MLP variant): attention with RoPE, every muP-style
        # scalar away from 1 so that a forgotten one shows; biased attention projections
        cls, extra = (transformers.GraniteMoeConfig, {}) if family == "granitemoe" else (
            transformers.GraniteMoeSharedConfig, dict(shared_intermediate_size=24))
        extra |= dict(num_local_experts=num_experts, intermediate_size=16, attention_bias=True,
                      embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=3.0)
    elif family == "granitemoe_swa":
        # granite-swash: GraniteMoeShared with a window of 4 in every layer but each fourth (from
        # the first), a learned sink per head, the fully attending layers without positions
        # (layer_rope_theta 0), every muP-style scalar away from 1
        cls, extra = transformers.GraniteMoeSWAConfig, dict(
            num_local_experts=num_experts, intermediate_size=16, shared_intermediate_size=24, attention_bias=True,
            embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=3.0,
            sliding_window=4, layer_rope_theta=[0.0 if i % 4 == 0 else 10000.0 for i in range(num_layers)],
        )
    elif family == "qwen3_vl_moe":
        # Qwen3-VL's language model (its checkpoint nests it beside a vision tower, here a tiny
        # one), M-RoPE sections that are plain RoPE for text; tied embeddings are the outer
        # config's say, so the text config's (True by default) must not leak out
        text = {**common, "num_experts": num_experts, "moe_intermediate_size": 8, "intermediate_size": 48,
                "head_dim": 16, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                    "mrope_section": [2, 3, 3], "mrope_interleaved": True}}
        text.pop("tie_word_embeddings")
        vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=4,
                      spatial_merge_size=2, num_position_embeddings=16, deepstack_visual_indexes=[0])
        outer = {k: overrides.pop(k) for k in ("tie_word_embeddings",) if k in overrides}
        return transformers.Qwen3VLMoeConfig(text_config={**text, **overrides}, vision_config=vision,
                                             tie_word_embeddings=outer.get("tie_word_embeddings", False))
    elif family == "lfm2_moe":
        # LFM2-MoE: gated short convolutions, then attention with per-head q/k norms; every layer
        # MoE unless num_dense_layers says; a sigmoid router whose expert bias changes picks
        cls, extra = transformers.Lfm2MoeConfig, dict(
            num_experts=num_experts, moe_intermediate_size=16, intermediate_size=48, num_dense_layers=0,
            routed_scaling_factor=1.5, conv_L_cache=3,
            layer_types=["conv" if i % 2 == 0 else "full_attention" for i in range(num_layers)],
        )
    elif family == "kimi_linear":
        # KDA layers around one MLA layer without positions; every layer MoE unless overridden
        cls, extra = transformers.KimiLinearConfig, dict(
            num_local_experts=num_experts, intermediate_size=48, moe_intermediate_size=16, num_key_value_heads=4,
            q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10,
            n_group=1, topk_group=1, n_shared_experts=1, routed_scaling_factor=2.0,
            linear_head_dim=8, linear_num_heads=4, linear_conv_kernel_dim=4,
            layer_types=["full_attention" if i % 2 else "linear_attention" for i in range(num_layers)],
            mlp_layer_types=["sparse"] * num_layers,
        )
    elif family == "nemotron_h":
        # one mixer per layer: Mamba-2, MoE, attention (no positions), MoE, Mamba-2 again, a relu^2 MLP
        cls, extra = transformers.NemotronHConfig, dict(
            n_routed_experts=num_experts, moe_intermediate_size=16, moe_shared_expert_intermediate_size=24,
            intermediate_size=48, head_dim=8, mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=8, n_groups=2,
            routed_scaling_factor=1.5,
            layers_block_type=["linear_attention", "moe", "full_attention", "moe", "linear_attention", "mlp"],
        )
    elif family in ("qwen3_next", "qwen3_5_moe"):
        # hybrid: Gated DeltaNet layers and a gated full-attention layer every second one;
        # two value heads per key head, partial RoPE (transformers' default 0.25)
        hybrid = dict(
            num_experts=num_experts, moe_intermediate_size=16, shared_expert_intermediate_size=24, head_dim=16,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
            linear_conv_kernel_dim=4,
            layer_types=["linear_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)],
        )
        if family == "qwen3_next":
            cls, extra = transformers.Qwen3NextConfig, dict(hybrid, intermediate_size=48)
        else:  # the language model of Qwen3.5 (Qwen3_5MoeForCausalLM)
            cls, extra = transformers.Qwen3_5MoeTextConfig, hybrid
    else:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    return cls(**{**common, **extra, **overrides})


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Re-draw every weight: unit-scale activations, norms near one, spread-out router logits."""
    g = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        if "norm" in name:
            p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
        elif name.endswith("bias"):
            p.copy_(0.2 * torch.randn(p.shape, generator=g))
        else:
            fan_in = p.shape[-1]
            # router gates (mlp.gate / block_sparse_moe.gate / mlp.router) and the shared-expert gate: wide logits
            wide = name.endswith(("gate.weight", "router.weight"))
            std = 3.0 / math.sqrt(fan_in) if wide else 1.0 / math.sqrt(fan_in)
            p.copy_(std * torch.randn(p.shape, generator=g))
    for name, b in sorted(model.named_buffers()):
        if name.endswith(("e_score_correction_bias", "expert_bias")):  # a router bias that changes picks
            b.copy_(0.3 * torch.randn(b.shape, generator=g))


def build_hf_model(family: str, *, seed: int = 0, **config_kwargs: Any):
    """A transformers model of `family` (float32, eval mode) with randomized weights."""
    import transformers

    config = hf_config(family, **config_kwargs)
    torch.manual_seed(seed)
    if family == "qwen3_vl_moe":  # no causal-LM class: the image-text model, prompted with text
        model = transformers.Qwen3VLMoeForConditionalGeneration(config).to(torch.float32)
    else:
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_(model, seed)
    return model.eval()


def write_tiny_checkpoint(
    path: str | Path,
    family: str = "qwen3_moe",
    *,
    seed: int = 0,
    max_shard_size: str | None = None,
    tokenizer: bool = True,
    **config_kwargs: Any,
) -> Path:
    """Write a tiny random checkpoint of `family` to `path` and return the path.

    config_kwargs: num_experts, top_k, num_layers, or any transformers config field
    (e.g. mlp_only_layers=[1] for a Qwen3-MoE with a dense layer). max_shard_size (e.g.
    "20KB") writes several shards plus model.safetensors.index.json.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model = build_hf_model(family, seed=seed, **config_kwargs)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    if tokenizer:
        write_byte_level_tokenizer(path)
    return path


def hf_gate_modules(hf) -> dict[int, torch.nn.Module]:
    """Layer index -> router gate of a transformers MoE model built by `build_hf_model`."""
    gates = {}
    decoder = getattr(hf.model, "language_model", hf.model)  # Qwen3-VL nests its language model
    for i, layer in enumerate(decoder.layers):
        moe = (getattr(layer, "block_sparse_moe", None) or getattr(layer, "mlp", None)
               or getattr(layer, "feed_forward", None) or layer.mixer)  # LFM2: feed_forward; Nemotron-H: mixer
        if hasattr(moe, "experts") and (hasattr(moe, "gate") or hasattr(moe, "router")):
            gates[i] = getattr(moe, "gate", None) or moe.router
    return gates


def hf_router_ids(gate: torch.nn.Module, inputs: tuple, output: tuple) -> torch.Tensor:
    """The [T, k] expert ids a transformers router module returned (a forward hook's
    arguments), in router order.

    Most routers return them sorted by score; sigmoid routers with a correction bias
    (GLM-4.5, MiniMax-M2, DeepSeek-V3) and DeepSeek-V2's return an unsorted top-k, which is
    put in r3srv's order here: descending score (+ bias), ties to the lower id.
    """
    ids = output[2]
    bias = getattr(gate, "e_score_correction_bias", None)  # GLM-4.5: the router holds it
    if bias is None and len(inputs) > 1:  # MiniMax-M2: the MoE block passes it in
        bias = inputs[1]
    if bias is not None:
        keys = (output[0].float().sigmoid() + bias).gather(1, ids)
    elif getattr(gate, "topk_method", None) is not None:  # DeepSeek-V2: softmax, ranked by its logits
        keys = output[0].float().gather(1, ids)
    else:
        return ids
    by_id = torch.sort(ids, dim=1).indices  # ties keep ascending ids through the stable sort
    ids, keys = ids.gather(1, by_id), keys.gather(1, by_id)
    return ids.gather(1, torch.sort(keys, dim=1, descending=True, stable=True).indices)


BOS_TEMPLATE_ID = 256  # <|endoftext|> of the byte-level tokenizer


def make_bos_adding_chat_checkpoint(path: Path) -> Path:
    """A tiny Mixtral whose tokenizer adds a BOS to every encode AND whose chat template
    writes `{{ bos_token }}` itself (as Mixtral's does): the case where encoding a rendered
    chat with the tokenizer's specials would double the BOS."""
    import json

    from tokenizers import processors

    from r3srv.models.builtin import byte_level_tokenizer

    path = write_tiny_checkpoint(path, "mixtral")
    tok = byte_level_tokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", BOS_TEMPLATE_ID)]
    )
    (path / "tokenizer.json").write_text(tok.to_str(), encoding="utf-8")
    config = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
    config.update(
        bos_token="<|endoftext|>",
        chat_template="{{ bos_token }}{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}",
    )
    (path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return path
