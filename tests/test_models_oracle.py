"""Each family against transformers (the test-only oracle) on tiny random checkpoints.

Logits, greedy continuation tokens and the captured routed experts must match what
transformers computes on the same prompt, its router's top-k read off the gate modules.
"""

from __future__ import annotations

import pytest
import torch

from r3srv.models.batch import ForwardBatch
from r3srv.models.loader import load_model
from tiny_checkpoints import build_hf_model, hf_gate_modules, hf_router_ids, write_tiny_checkpoint

pytest.importorskip("transformers")

BLOCK_SIZE = 4
NEW_TOKENS = 6

VARIANTS = {
    "qwen3_moe": ("qwen3_moe", {}),
    "qwen3_moe_dense_layers": ("qwen3_moe", {"num_layers": 4, "mlp_only_layers": [0], "decoder_sparse_step": 2}),
    "qwen2_moe": ("qwen2_moe", {}),
    "qwen2_moe_no_renorm_16e": ("qwen2_moe", {"num_experts": 16, "top_k": 4, "norm_topk_prob": False}),
    "mixtral": ("mixtral", {}),
    "olmoe": ("olmoe", {"num_experts": 16, "top_k": 4}),
    "olmoe_no_clip": ("olmoe", {"clip_qkv": None}),
    "qwen3_moe_tied_embeddings": ("qwen3_moe", {"tie_word_embeddings": True}),
    "glm4_moe": ("glm4_moe", {}),
    "glm4_moe_dense_first_qk_norm": (
        "glm4_moe", {"num_layers": 3, "first_k_dense_replace": 1, "use_qk_norm": True, "attention_bias": False}
    ),
    "glm4_moe_groups_no_renorm": (
        "glm4_moe", {"num_experts": 16, "top_k": 4, "n_group": 4, "topk_group": 2, "norm_topk_prob": False}
    ),
    "glm4_moe_full_rotary_2_shared": (
        "glm4_moe", {"rope_parameters": {"rope_theta": 500.0, "rope_type": "default", "partial_rotary_factor": 1.0},
                     "n_shared_experts": 2}
    ),
    "minimax_m2": ("minimax_m2", {}),
    "minimax_m2_32e_top8": ("minimax_m2", {"num_experts": 32, "top_k": 8, "num_layers": 3}),
    "deepseek_v3": ("deepseek_v3", {}),
    # DeepSeek-V3's own switches: expert groups, YaRN with mscale (softmax scale and cos/sin),
    # a dense first layer, q without the low-rank pair, biased projections
    "deepseek_v3_groups_yarn": (
        "deepseek_v3",
        {"num_experts": 16, "top_k": 4, "n_group": 4, "topk_group": 2, "num_layers": 3, "first_k_dense_replace": 1,
         "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 8, "beta_fast": 32, "beta_slow": 1,
                             "mscale": 1.0, "mscale_all_dim": 1.0}},
    ),
    "deepseek_v3_no_q_lora_not_interleaved": (
        "deepseek_v3", {"q_lora_rank": None, "rope_interleave": False, "attention_bias": True}
    ),
    "deepseek_v2": ("deepseek_v2", {}),
    # V2's group_limited_greedy (a group scores its best expert), a low-rank q, YaRN with mscale
    "deepseek_v2_groups_q_lora_yarn": (
        "deepseek_v2",
        {"num_experts": 16, "top_k": 4, "topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2,
         "q_lora_rank": 24, "num_layers": 3, "first_k_dense_replace": 1,
         "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 8, "mscale": 0.707, "mscale_all_dim": 0.707}},
    ),
    "gpt_oss": ("gpt_oss", {}),
    # all-windowed layers and a SwiGLU limit low enough that the clamps bite
    "gpt_oss_windows_clamped": (
        "gpt_oss", {"num_layers": 3, "layer_types": ["sliding_attention"] * 3, "swiglu_limit": 0.5, "top_k": 4}
    ),
    "ernie4_5_moe": ("ernie4_5_moe", {}),
    "ernie4_5_moe_dense_interval_tied": (
        "ernie4_5_moe", {"num_layers": 4, "moe_layer_start_index": 1, "moe_layer_interval": 2, "moe_num_shared_experts": 2,
                         "tie_word_embeddings": True}
    ),
    "glm4_moe_lite": ("glm4_moe_lite", {}),
    "glm4_moe_lite_dense_first": ("glm4_moe_lite", {"num_layers": 3, "mlp_layer_types": ["dense", "sparse", "sparse"]}),
    "dots1": ("dots1", {}),
    "dots1_dense_first_groups": ("dots1", {"num_layers": 3, "first_k_dense_replace": 1, "num_experts": 16, "top_k": 4,
                                           "n_group": 4, "topk_group": 2, "norm_topk_prob": False}),
    # sliding windows by each family's rule (a window of 4: prompts and decodes run past it)
    "mixtral_sliding_window": ("mixtral", {"sliding_window": 4}),
    "qwen3_moe_sliding_window": ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 4}),
    "qwen2_moe_sliding_window": ("qwen2_moe", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}),
    # hybrids: Gated DeltaNet layers (prefill, then decodes continuing their states) and gated attention
    "qwen3_next": ("qwen3_next", {}),
    # transformers' layer rule (a full-attention layer every 4th), a dense layer, one value head per key head
    "qwen3_next_interval_dense_layer": (
        "qwen3_next", {"num_layers": 4, "layer_types": None, "mlp_only_layers": [2], "linear_num_value_heads": 2}
    ),
    "qwen3_5_moe": ("qwen3_5_moe", {}),
    # sparse attention: an indexer's top-5 keys per query (its own rotary layout per family)
    "deepseek_v32": ("deepseek_v32", {}),
    "glm_moe_dsa": ("glm_moe_dsa", {}),
    # three layers: full, shared, full; a dense first layer; a wider selection than the prompt
    "glm_moe_dsa_full_shared_full": (
        "glm_moe_dsa", {"num_layers": 3, "indexer_types": ["full", "shared", "full"], "first_k_dense_replace": 1}
    ),
    # Nemotron-H: Mamba-2 layers (prefill, then decodes continuing their states), attention
    # without positions, relu^2 experts under DeepSeek-V3's router (here with expert groups)
    "nemotron_h": ("nemotron_h", {}),
    "nemotron_h_groups_16e": ("nemotron_h", {"num_experts": 16, "top_k": 4, "n_group": 4, "topk_group": 2}),
    # Kimi-Linear: Kimi Delta Attention (per-channel decay) and MLA without positions
    "kimi_linear": ("kimi_linear", {}),
    "kimi_linear_dense_first_3_layers": (
        "kimi_linear", {"num_layers": 3, "mlp_layer_types": ["dense", "sparse", "sparse"], "num_experts": 16, "top_k": 4}
    ),
    # Granite-4.0-H: Mamba-2 beside attention, muP-style scalars, an always-on shared MLP; with RoPE too
    "granitemoehybrid": ("granitemoehybrid", {}),
    "granitemoehybrid_rope_3_layers": ("granitemoehybrid", {"num_layers": 3, "position_embedding_type": "rope"}),
    # Qwen3-VL-MoE's language model, from its multimodal checkpoint (fused experts as transformers
    # 5 saves them); tied embeddings by the outer config
    "qwen3_vl_moe": ("qwen3_vl_moe", {}),
    "qwen3_vl_moe_tied_dense_layer": ("qwen3_vl_moe", {"num_layers": 3, "mlp_only_layers": [1], "tie_word_embeddings": True}),
    # LFM2-MoE: gated short convolutions (prefill, then decodes continuing their windows) beside
    # attention; a dense first layer and no expert bias in the second variant
    "lfm2_moe": ("lfm2_moe", {}),
    "lfm2_moe_dense_first_no_bias_4_layers": (
        "lfm2_moe", {"num_layers": 4, "num_dense_layers": 1, "use_expert_bias": False, "norm_topk_prob": False}
    ),
    # Granite 3.x MoE: RoPE attention with biases, muP-style scalars; GraniteMoeShared's shared MLP
    "granitemoe": ("granitemoe", {}),
    "granitemoeshared_3_layers_16e": ("granitemoeshared", {"num_layers": 3, "num_experts": 16, "top_k": 4}),
    # GraniteMoeSWA: windows and sinks, position-free full layers; without layer_rope_theta every
    # layer rotates by the one base (5 layers: two full, three windowed)
    "granitemoe_swa": ("granitemoe_swa", {}),
    # FlexOlmo: OLMo-2's layout (no norm before a branch, one on its output). norm_topk_prob
    # scales a token's expert mix by one number, which the output norm cancels (a dropped
    # renormalisation passes here, rightly); the variant checks the parse and the ids
    "flex_olmo": ("flex_olmo", {}),
    "flex_olmo_3_layers_top3_renormalized": ("flex_olmo", {"num_layers": 3, "norm_topk_prob": True, "top_k": 3}),
    "granitemoe_swa_rope_everywhere_5_layers": ("granitemoe_swa", {"num_layers": 5, "layer_rope_theta": None}),
    # Arcee's AFMoE: windowed RoPE layers and position-free full layers, sandwich norms, gated output
    "afmoe": ("afmoe", {}),
    "afmoe_dense_first_4_layers": ("afmoe", {"num_layers": 4, "num_dense_layers": 1, "mup_enabled": False}),
    "qwen3_moe_yarn": (
        "qwen3_moe", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                          "original_max_position_embeddings": 8}}
    ),
}


class Case:
    def __init__(self, path, family, kwargs, sharded):
        self.hf = build_hf_model(family, seed=1, **kwargs)
        write_tiny_checkpoint(path, family, seed=1, max_shard_size="40KB" if sharded else None, **kwargs)
        self.model, self.tokenizer = load_model(path)
        self.gates = hf_gate_modules(self.hf)


@pytest.fixture(scope="module", params=list(VARIANTS))
def case(request, tmp_path_factory):
    family, kwargs = VARIANTS[request.param]
    # every other variant is written as several shards with an index
    sharded = list(VARIANTS).index(request.param) % 2 == 1
    return Case(tmp_path_factory.mktemp(request.param), family, kwargs, sharded)


def _hf_run(case: Case, ids: list[int], past=None):
    """transformers forward: (logits [T, V], router ids per MoE layer [T, k], past)."""
    picked: dict[int, torch.Tensor] = {}
    hooks = [
        gate.register_forward_hook(lambda m, inp, out, i=i: picked.__setitem__(i, hf_router_ids(m, inp, out).clone()))
        for i, gate in case.gates.items()
    ]
    try:
        with torch.no_grad():
            out = case.hf(torch.tensor([ids]), past_key_values=past, use_cache=True)
    finally:
        for h in hooks:
            h.remove()
    return out.logits[0].float(), picked, out.past_key_values


def _step(model, ids: list[int], start: int, logits_all: bool = False):
    """One of our forward steps for a single sequence occupying blocks 0.. in order."""
    cfg = model.config
    t, ctx = len(ids), start + len(ids)
    positions = torch.arange(start, ctx)
    tables = torch.arange((ctx + BLOCK_SIZE - 1) // BLOCK_SIZE, dtype=torch.int32)[None]
    batch = ForwardBatch(
        input_ids=torch.tensor(ids),
        positions=positions,
        slot_mapping=positions.clone(),
        query_lens=[t],
        context_lens=[ctx],
        block_tables=tables,
        logits_indices=torch.arange(t) if logits_all else torch.tensor([t - 1]),
        routing_capture=torch.zeros(t, cfg.num_layers, cfg.top_k, dtype=torch.int32),
    )
    return model.forward(batch), batch.routing_capture


def _prompt(n: int = 11) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(7)).tolist()


def test_prefill_logits_and_routing_match_transformers(case):
    model = case.model
    model.init_kv_cache(16, BLOCK_SIZE)
    prompt = _prompt()
    ref_logits, ref_ids, _ = _hf_run(case, prompt)
    logits, capture = _step(model, prompt, 0, logits_all=True)
    assert logits.dtype == torch.float32 and logits.shape == ref_logits.shape
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
    cfg = model.config
    assert sorted(ref_ids) == cfg.moe_layers
    for layer in range(cfg.num_layers):
        if layer in ref_ids:
            assert torch.equal(capture[:, layer].long(), ref_ids[layer].long()), f"layer {layer}"
        else:  # a dense layer leaves its rows zero
            assert not capture[:, layer].any()


def test_greedy_continuation_and_routing_match_transformers(case):
    model = case.model
    model.init_kv_cache(16, BLOCK_SIZE)
    prompt = _prompt()
    # transformers: prefill then one token at a time through its own KV cache
    ref_tokens, ref_rows = [], []
    logits, picked, past = _hf_run(case, prompt)
    ref_rows.append(picked)
    for _ in range(NEW_TOKENS):
        ref_tokens.append(int(logits[-1].argmax()))
        logits, picked, past = _hf_run(case, [ref_tokens[-1]], past)
        ref_rows.append(picked)
    # ours: prefill then decode steps through the paged cache (crossing block boundaries)
    tokens, rows = [], []
    logits, capture = _step(model, prompt, 0)
    rows.append(capture)
    for _ in range(NEW_TOKENS):
        tokens.append(int(logits[0].argmax()))
        logits, capture = _step(model, [tokens[-1]], len(prompt) + len(tokens) - 1)
        rows.append(capture)
    assert tokens == ref_tokens
    ours = torch.cat(rows)
    for layer in model.config.moe_layers:
        ref = torch.cat([r[layer] for r in ref_rows])
        assert torch.equal(ours[:, layer].long(), ref.long()), f"layer {layer}"
