"""The router's weights beside the routed experts (--enable-return-routed-expert-weights),
against transformers' router modules on tiny checkpoints: a softmax router (Qwen3-MoE) and a
sigmoid router with a correction bias and a scaling factor (GLM-4.5)."""

from __future__ import annotations

import numpy as np
import pytest

from r3srv import LLM, SamplingParams, settings
from r3srv.config import EngineConfig, ParallelConfig
from r3srv.errors import ConfigError, InvalidRequestError
from tiny_checkpoints import build_hf_model, hf_router_weights, write_tiny_checkpoint

pytestmark = pytest.mark.slow  # transformers oracles

pytest.importorskip("transformers")

# The engine computes the prompt in one prefill and each later token in a decode step, the
# oracle the whole sequence at once: the hidden states differ in the last float32 bits.
RTOL, ATOL = 1e-5, 1e-6


@pytest.mark.parametrize("family,kwargs", [("qwen3_moe", {"num_layers": 3, "mlp_only_layers": [1]}),
                                           ("glm4_moe", {})])
@pytest.mark.parametrize("torch_router", [False, True], ids=["cpu_kernels", "torch_router"])
def test_weights_match_transformers_router(family, kwargs, torch_router, tmp_path):
    path = write_tiny_checkpoint(tmp_path / family, family, seed=5, **kwargs)
    hf = build_hf_model(family, seed=5, **kwargs)
    with settings.overridden(force_torch_router=torch_router):
        _check_against(hf, path)


def _check_against(hf, path) -> None:
    llm = LLM(str(path), block_size=4, num_kv_blocks=64, max_model_len=128, enable_return_routed_expert_weights=True)
    cfg = llm.model_config
    prompts = [list(b"Router weights, please"), list(b"MoE!")]
    params = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, routed_experts_prompt_start=start,
                             return_routed_expert_weights=True) for start in (0, 3)]
    first = llm.generate(prompts, params)
    again = llm.generate(prompts[:1], params[:1])[0]  # its prompt's full blocks from the prefix cache
    assert again.num_cached_tokens > 0
    for prompt, param, out in zip(prompts + prompts[:1], params + params[:1], first + [again]):
        c = out.outputs[0]
        full = prompt + list(c.token_ids)
        ids, weights = hf_router_weights(hf, full[:-1], cfg.num_layers, cfg.top_k)
        start = param.routed_experts_prompt_start
        assert c.routed_expert_weights.dtype == np.float32
        assert c.routed_expert_weights.shape == c.routed_experts.shape == ids[start:].shape
        np.testing.assert_array_equal(c.routed_experts, ids[start:])
        np.testing.assert_allclose(c.routed_expert_weights, weights[start:], rtol=RTOL, atol=ATOL)
        assert np.count_nonzero(c.routed_expert_weights) > 0
    # without the ask: no weights
    plain = llm.generate([prompts[0]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0].outputs[0]
    assert plain.routed_expert_weights is None


def test_config_needs_the_rows():
    with pytest.raises(ConfigError, match="enable_return_routed_experts"):
        EngineConfig(enable_return_routed_experts=False, enable_return_routed_expert_weights=True)
    # tensor parallelism is served (rank 0 captures them): tests/test_parallel_signals.py
    EngineConfig(enable_return_routed_expert_weights=True, parallel=ParallelConfig(tensor_parallel_size=2))


def test_weights_refused_without_the_flag(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "q", "qwen3_moe", seed=5)
    llm = LLM(str(path), block_size=4, num_kv_blocks=32, max_model_len=64)
    with pytest.raises(InvalidRequestError) as err:
        llm.generate([list(b"hi")], SamplingParams(max_tokens=2, return_routed_expert_weights=True))
    assert err.value.param == "return_routed_expert_weights"
    on = LLM(str(path), block_size=4, num_kv_blocks=32, max_model_len=64, enable_return_routed_expert_weights=True)
    with pytest.raises(InvalidRequestError) as err:  # weights without the rows they weigh
        on.generate([list(b"hi")], SamplingParams(max_tokens=2, return_routed_experts=False,
                                                  return_routed_expert_weights=True))
    assert err.value.param == "return_routed_expert_weights"
