"""Hybrid models through the engine on CUDA: chunked scans for prefills, the fused Triton decode
steps (kernels/recurrent_triton.py) updating states in the pool, grouped prefill scans. Greedy
tokens and routed experts equal the CPU engine's, and the fused steps equal the torch steps on
the GPU. Skipped (with the reason) without CUDA."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_testing import GREEDY, full_precision_matmuls, prompt_ids  # noqa: F401 (fixture)
from r3srv import LLM, SamplingParams
from tiny_checkpoints import write_tiny_checkpoint

pytest.importorskip("transformers")
pytestmark = pytest.mark.gpu

# family -> (its fused step, checkpoint overrides)
HYBRIDS = {
    "qwen3_next": ("delta_rule_step_triton", dict(num_layers=3)),
    "kimi_linear": ("delta_rule_step_triton", dict(num_layers=3)),
    "nemotron_h": ("ssm_step_triton", {}),
    "granitemoehybrid": ("ssm_step_triton", dict(num_layers=3)),
    "lfm2_moe": (None, dict(num_layers=3)),  # a convolution alone: no fused step
}
# prompts of 5..40 tokens decoding together, one longer than a chunk of the chunked scans
PROMPTS = [prompt_ids(5), prompt_ids(23, base=3), prompt_ids(40, base=6)]


def _generate(path, device: str):
    llm = LLM(path, device=device, dtype="float32", max_model_len=128, block_size=4)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=10, **GREEDY))
    states = llm.engine.block_manager.states
    assert llm.stats().kv_blocks_used == 0 and states.num_used_slots == 0
    return [(o.outputs[0].token_ids, o.outputs[0].routed_experts) for o in outs]


def _assert_same(got, want):
    for (tokens, rows), (want_tokens, want_rows) in zip(got, want):
        assert tokens == want_tokens
        np.testing.assert_array_equal(rows, want_rows)


def _checkpoint(family, tmp_path):
    step, overrides = HYBRIDS[family]
    return write_tiny_checkpoint(tmp_path / "ckpt", family, seed=5, **overrides), step


@pytest.fixture
def counted_fused_steps(monkeypatch):
    """Counts the calls of each fused step (in the engines built meanwhile: the CUDA backend takes
    the kernels when a model is built)."""
    from r3srv.kernels import recurrent_triton

    calls = {"delta_rule_step_triton": 0, "ssm_step_triton": 0}
    for name in calls:
        def counting(*args, _step=getattr(recurrent_triton, name), _name=name):
            calls[_name] += 1
            return _step(*args)
        monkeypatch.setattr(recurrent_triton, name, counting)
    return calls


@pytest.mark.parametrize("family", list(HYBRIDS))
def test_cuda_hybrid_engine_matches_the_cpu_engine(family, tmp_path, full_precision_matmuls, counted_fused_steps):
    path, step = _checkpoint(family, tmp_path)
    gpu = _generate(path, "cuda")
    assert step is None or counted_fused_steps[step] > 0, f"the CUDA decodes never took {step}"
    _assert_same(gpu, _generate(path, "cpu"))


@pytest.mark.parametrize("family", [family for family, (step, _) in HYBRIDS.items() if step is not None])
def test_fused_steps_equal_the_torch_steps_on_cuda(family, tmp_path, full_precision_matmuls, counted_fused_steps,
                                                   r3srv_settings):
    path, step = _checkpoint(family, tmp_path)
    fused = _generate(path, "cuda")
    assert counted_fused_steps[step] > 0
    r3srv_settings(fused_step=False)
    calls = dict(counted_fused_steps)
    unfused = _generate(path, "cuda")
    assert counted_fused_steps == calls  # settings.fused_step off: the torch steps only
    _assert_same(fused, unfused)
