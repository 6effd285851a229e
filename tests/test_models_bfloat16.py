"""Every family serves in bfloat16 on the CPU: the dtype a GPU serves in, so a float32-only
path (a cast forgotten, a float32 state meeting a bfloat16 weight) fails here, not on a GPU."""

from __future__ import annotations

import math

import numpy as np
import pytest

from r3srv import LLM, SamplingParams
from tiny_checkpoints import FAMILIES, write_tiny_checkpoint

pytestmark = pytest.mark.slow  # transformers oracles

pytest.importorskip("transformers")


@pytest.mark.parametrize("family", FAMILIES)
def test_bfloat16_generation(family, tmp_path):
    llm = LLM(str(write_tiny_checkpoint(tmp_path / family, family, seed=3)), dtype="bfloat16", max_model_len=64,
              block_size=4)
    assert llm.engine.model.embed.weight.dtype.itemsize == 2
    cfg = llm.model_config
    prompts = [list(range(30, 50)), list(range(60, 63))]  # a chunk past DSA's top-5 and a short one
    outs = llm.generate(prompts, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=1))
    for prompt, out in zip(prompts, outs):
        choice = out.outputs[0]
        assert len(choice.token_ids) == 5 and choice.finish_reason == "length"
        assert all(math.isfinite(lp[t]) for lp, t in zip(choice.logprobs, choice.token_ids))
        rows = choice.routed_experts
        assert rows.shape == (len(prompt) + 4, cfg.num_layers, cfg.top_k) and rows.dtype == np.uint8
        moe = rows[:, cfg.moe_layers]
        assert int(moe.max()) < cfg.num_experts and all(len(set(r)) == cfg.top_k for r in moe.reshape(-1, cfg.top_k))
