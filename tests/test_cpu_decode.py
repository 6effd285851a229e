"""The CPU decode fast path (r3srv.models.cpu_decode): a plain MoE layer's decode step as
straight kernel calls gives the modules' tokens, logprobs and routed experts bit for bit, on
generated prompts, greedy and sampled, at one and two threads, in float32 and bfloat16; it runs at decode steps only,
only where the setting is on, and only for layers whose every part it covers."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from engine_testing import one_torch_thread  # noqa: F401 (autouse fixture)
from r3srv import LLM, SamplingParams
from r3srv.models import cpu_decode
from r3srv.models.cpu_decode import FastDecodeLayer


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=512, enable_prefix_caching=False, max_num_seqs=8, enable_return_routed_experts=True)


@pytest.fixture
def fast_calls(monkeypatch):
    """How many layer steps took the fast path since the test began (reset by calls.clear())."""
    calls = []
    run = FastDecodeLayer.__call__

    def counted(self, *args, **kwargs):
        calls.append(self)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(FastDecodeLayer, "__call__", counted)
    return calls


def generated_requests(seed: int, n: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """n prompts of 1-120 random byte tokens, half greedy and half sampled with their own seeds,
    all with logprobs."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 256, int(rng.integers(1, 121))).tolist() for _ in range(n)]
    params = [SamplingParams(max_tokens=int(rng.integers(2, 24)), ignore_eos=True, logprobs=3,
                             temperature=0.0 if i % 2 == 0 else 0.9, seed=None if i % 2 == 0 else int(rng.integers(1 << 30)))
              for i in range(n)]
    return prompts, params


def outputs(llm, prompts, params) -> list:
    results = llm.generate(prompts, params)
    return [(o.outputs[0].token_ids, o.outputs[0].routed_experts,
             list(o.outputs[0].logprobs))
            for o in results]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("seed", [0, 1])
def test_the_same_bits_as_the_modules(llm, r3srv_settings, fast_calls, threads, seed):
    assert_the_modules_bits(llm, r3srv_settings, fast_calls, threads, seed, 10)


def assert_the_modules_bits(llm, r3srv_settings, fast_calls, threads: int, seed: int, n: int) -> None:
    """n generated requests give the same tokens, rows and logprobs with the fast path (which
    runs whole steps, every layer) as with the modules."""
    prompts, params = generated_requests(seed, n)
    r3srv_settings(cpu_threads=threads, fast_cpu_decode=True)
    fast = outputs(llm, prompts, params)
    layers = len(llm.engine.core.executor.runner.model.layers)
    assert fast_calls and len(fast_calls) % layers == 0  # whole steps, every layer
    fast_calls.clear()
    r3srv_settings(fast_cpu_decode=False)
    modules = outputs(llm, prompts, params)
    assert not fast_calls
    for (tokens, rows, logprobs), (want_tokens, want_rows, want_logprobs) in zip(fast, modules):
        assert tokens == want_tokens
        assert rows is not None and rows.shape[1:] == want_rows.shape[1:] == (4, 8)
        np.testing.assert_array_equal(rows, want_rows)
        assert logprobs == want_logprobs  # the same logits, bit for bit


@pytest.mark.parametrize("float32_gate", [False, True])
def test_bfloat16_the_same_bits_as_the_modules(r3srv_settings, fast_calls, float32_gate):
    """A bfloat16 model (weights, activations, KV cache) takes the fast path too, with its router
    gate in bfloat16 or float32 (a float32 router in a bfloat16 model casts the normed rows)."""
    bf16 = LLM(dtype="bfloat16", max_model_len=512, enable_prefix_caching=False, max_num_seqs=8,
               enable_return_routed_experts=True)
    model = bf16.engine.core.executor.runner.model
    assert model.layers[0].attn.k_cache.dtype == torch.bfloat16
    if float32_gate:
        for layer in model.layers:
            layer.mlp.gate = torch.nn.Parameter(layer.mlp.gate.float(), requires_grad=False)
    assert_the_modules_bits(bf16, r3srv_settings, fast_calls, 2, 3, 8)


def test_prefill_steps_keep_the_modules(llm, r3srv_settings, fast_calls):
    r3srv_settings(fast_cpu_decode=True)
    llm.generate([[1, 2, 3] * 20, [7] * 45], SamplingParams(max_tokens=1, ignore_eos=True))  # prefill steps only
    assert not fast_calls
    llm.generate([[1, 2, 3] * 20, [7] * 45], SamplingParams(max_tokens=3, ignore_eos=True))
    assert fast_calls  # the two decode steps after it


def test_without_routed_experts_too(r3srv_settings, fast_calls):
    prompts, params = generated_requests(2, 6)
    plain = LLM(max_model_len=512, enable_prefix_caching=False, max_num_seqs=8, enable_return_routed_experts=False)
    r3srv_settings(fast_cpu_decode=True)
    fast = outputs(plain, prompts, params)
    assert fast_calls
    r3srv_settings(fast_cpu_decode=False)
    modules = outputs(plain, prompts, params)
    assert [(t, lp) for t, _, lp in fast] == [(t, lp) for t, _, lp in modules]
    assert all(rows is None for _, rows, _ in fast)


def _unlike(case: str, layer) -> None:
    """Changes one part of `layer` to something the fast path does not cover."""
    attn, moe = layer.attn, layer.mlp
    if case == "window":
        attn.window = 8
    elif case == "sinks":
        attn.sinks = torch.zeros(attn.num_heads)
    elif case == "output gate":
        attn.gate = torch.nn.Linear(4, 4)
    elif case == "q/k norm over all heads":
        attn.fused_heads = False
    elif case == "shared expert":
        moe.shared = torch.nn.Identity()
    elif case == "correction bias":
        moe.correction_bias = torch.zeros(moe.gate.shape[0])
    elif case == "expert groups":
        moe.num_groups = 2
    elif case == "expert biases":
        moe.experts.b2 = torch.zeros(moe.experts.w2.shape[:2])
    elif case == "residual multiplier":
        layer.residual_multiplier = 0.5
    elif case == "no pre-norm":
        layer.input_norm = None
    elif case == "sandwich norm":
        layer.attn_out_norm = layer.post_attention_norm
    elif case == "bfloat16 experts":
        moe.experts.w13.data = moe.experts.w13.data.to(torch.bfloat16)
    elif case == "another expert pass":
        moe.expert_pass = lambda *args, **kwargs: None
    else:
        raise AssertionError(case)


@pytest.mark.parametrize("case", ["window", "sinks", "output gate", "q/k norm over all heads", "shared expert",
                                  "correction bias", "expert groups", "expert biases", "residual multiplier",
                                  "no pre-norm", "sandwich norm", "bfloat16 experts", "another expert pass"])
def test_only_layers_it_covers(llm, case):
    layer = copy.deepcopy(llm.engine.core.executor.runner.model.layers[0])
    assert FastDecodeLayer.eligible(layer)
    _unlike(case, layer)
    assert not FastDecodeLayer.eligible(layer)


def test_the_step_plan_declines_what_the_kernels_would(llm, r3srv_settings):
    """plan() is None for a prefill, for more rows than the Rust linear takes, and with any of
    the kernels it calls turned off."""
    model = llm.engine.core.executor.runner.model
    assert all(model._fast_decode_layers())
    meta = type("Meta", (), dict(prefills=[], decode_seqs=[0], graph=False, block_size=16,
                                 decode_kernel_args=lambda self: (torch.zeros(1, 2, dtype=torch.int64),
                                                                  torch.ones(1, dtype=torch.int64),
                                                                  torch.zeros(1, dtype=torch.int64), 1)))()
    x, cos = torch.zeros(1, 256), torch.zeros(1, 64)
    assert cpu_decode.DecodeStep.plan(x, meta, cos, cos, None, 64) is not None
    meta.prefills = [object()]
    assert cpu_decode.DecodeStep.plan(x, meta, cos, cos, None, 64) is None
    meta.prefills = []
    rows = cpu_decode.linear_cpu.MAX_ROWS + 1
    meta.decode_seqs = list(range(rows))
    assert cpu_decode.DecodeStep.plan(torch.zeros(rows, 256), meta, torch.zeros(rows, 64), torch.zeros(rows, 64),
                                      None, 64) is None
    meta.decode_seqs = [0]
    assert cpu_decode.DecodeStep.plan(x.to(torch.bfloat16), meta, cos, cos, None, 64) is None  # cos of another dtype
    half = cos.to(torch.bfloat16)
    assert cpu_decode.DecodeStep.plan(x.to(torch.bfloat16), meta, half, half, None, 64) is not None
    assert cpu_decode.DecodeStep.plan(x.half(), meta, cos.half(), cos.half(), None, 64) is None
    for switch in ("fast_cpu_decode", "rust_linear", "rust_rms_norm", "rust_rope", "rust_decode", "cpu_expert_kernel",
                   "rust_router"):
        r3srv_settings(**{switch: False})
        assert cpu_decode.DecodeStep.plan(x, meta, cos, cos, None, 64) is None, switch
        r3srv_settings(**{switch: True})
    r3srv_settings(force_torch_router=True)
    assert cpu_decode.DecodeStep.plan(x, meta, cos, cos, None, 64) is None
