"""GraniteMoeSWA (granite-swash): GraniteMoeShared with sliding-window layers (by default every
fourth layer, from the first, attends fully), a learned per-head sink in every layer
(transformers scales the output by sigmoid(lse - sink): the sink logit in the softmax's
denominator, gpt-oss's form), and a RoPE base per layer where 0 means no positions. One base
for all rotary layers is supported; several are refused."""

from __future__ import annotations

from dataclasses import replace

from r3srv.errors import ConfigError
from r3srv.models.families import Family, granitemoe
from r3srv.models.families._parsing import layer_windows


def configure(cfg, raw, get):
    n = cfg.num_layers
    default = ["full_attention" if i % 4 == 0 else "sliding_attention" for i in range(n)]
    windows = layer_windows({"sliding_window": 128, **raw}, n, "GraniteMoeSWAForCausalLM", default=default)
    cfg = granitemoe.with_granite_scalars(cfg, raw, sinks=True, sliding_windows=windows)
    thetas = raw.get("layer_rope_theta")
    if thetas is None:
        return cfg
    if len(thetas) != n:
        raise ConfigError(f"GraniteMoeSWAForCausalLM: layer_rope_theta has {len(thetas)} entries for {n} layers")
    bases = sorted({float(t) for t in thetas if t})
    if len(bases) > 1:
        raise ConfigError(f"GraniteMoeSWAForCausalLM: layer_rope_theta uses several RoPE bases {bases}; "
                          "only one (besides 0, no positions) is supported")
    rope = replace(cfg.rope, layers=[i for i, t in enumerate(thetas) if t])
    return replace(cfg, rope=replace(rope, theta=bases[0]) if bases else rope)


FAMILY = Family("granitemoe_swa", ("GraniteMoeSWAForCausalLM",), configure, granitemoe.weight_targets)
