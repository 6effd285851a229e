"""DeepSeek-V2 / V2-Lite: multi-head latent attention, a softmax router, greedy or
group_limited_greedy (a group scores its best expert), no renormalisation unless
norm_topk_prob, gate-less shared experts."""

from __future__ import annotations

from dataclasses import replace

from r3srv.errors import ConfigError
from r3srv.models.families import Family, deepseek_v3, glm4_moe
from r3srv.models.specs import ExpertSpec, RouterSpec


def configure(cfg, raw, get):
    method = raw.get("topk_method", "greedy")
    if method not in ("greedy", "group_limited_greedy") or raw.get("scoring_func", "softmax") != "softmax":
        raise ConfigError(
            f"DeepseekV2ForCausalLM: topk_method={method!r} / scoring_func={raw.get('scoring_func')!r} is not "
            "supported (only softmax with 'greedy' or 'group_limited_greedy')"
        )
    if raw.get("mlp_bias"):
        raise ConfigError("DeepseekV2ForCausalLM: mlp_bias=true is not supported")
    grouped = method == "group_limited_greedy"
    width = get.int("moe_intermediate_size")
    cfg = replace(
        cfg,
        moe_intermediate_size=width,
        router=RouterSpec(renormalize=bool(raw.get("norm_topk_prob", False)),
                          scaling=float(raw.get("routed_scaling_factor", 1.0)),
                          num_groups=int(raw.get("n_group") or 1) if grouped else 1,
                          topk_groups=int(raw.get("topk_group") or 1) if grouped else 1,
                          group_score_top=1,
                          float32=True),  # the references compute these logits in float32
        experts=ExpertSpec(shared_intermediate_size=width * int(raw.get("n_shared_experts") or 0), shared_gate=False),
    )
    return deepseek_v3.with_mla(cfg, raw, get, first_dense_default=0)


FAMILY = Family("deepseek_v2", ("DeepseekV2ForCausalLM",), configure, glm4_moe.weight_targets)
