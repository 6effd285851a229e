"""GLM-5: DeepSeek-V3.2's sparse attention with interleaved index rotary, and "shared" layers
(indexer_types, or transformers' pattern / frequency rule) that reuse the last full layer's
selection."""

from __future__ import annotations

from r3srv.models.families import Family, deepseek_v32, glm4_moe


def indexer_types(raw, num_layers: int) -> list[str]:
    pattern = raw.get("index_topk_pattern")
    if pattern is not None:
        return [{"F": "full", "S": "shared"}.get(c, c) for c in pattern]
    freq = max(int(raw.get("index_topk_freq") or 1), 1)
    offset = int(raw.get("index_skip_topk_offset", 2))
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers)]


def configure(cfg, raw, get):
    types = None if raw.get("indexer_types") is not None else indexer_types(raw, cfg.num_layers)
    return deepseek_v32.with_sparse_attention(cfg, raw, get, "GlmMoeDsaForCausalLM", interleave=True, types=types)


FAMILY = Family("glm_moe_dsa", ("GlmMoeDsaForCausalLM",), configure, glm4_moe.weight_targets)
