"""FlexOlmo: its tiny transformers config and its oracle variants (checks: tests/family_oracle.py)."""

from family_oracle import *  # noqa: F403 (the oracle checks, run on every entry of VARIANTS)


def tiny_config(transformers, *, num_experts, top_k, num_layers):
    # FlexOlmo: OLMoE's router and q/k norms in OLMo-2's layout (only branch outputs normalised)
    return transformers.FlexOlmoConfig, dict(num_experts=num_experts, intermediate_size=16)


VARIANTS = {
    # FlexOlmo: OLMo-2's layout (no norm before a branch, one on its output). norm_topk_prob
    # scales a token's expert mix by one number, which the output norm cancels (a dropped
    # renormalisation passes here, rightly); the variant checks the parse and the ids
    "flex_olmo": {},
    "flex_olmo_3_layers_top3_renormalized": {"num_layers": 3, "norm_topk_prob": True, "top_k": 3},
}
