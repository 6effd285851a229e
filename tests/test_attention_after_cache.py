"""A prefill chunk after cached tokens on the CPU: the two flash attentions merged by their
log-sum-exps (ops/attention.py's _attend_after_cache) against one SDPA call with the shifted
causal mask, on generated shapes; and that the CPU backend's prefill op takes it."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from r3srv.ops import attention


def chunk(seed: int, heads: int, kv_heads: int, cached: int, new: int, dim: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, new, dim, generator=g).to(dtype)
    k = torch.randn(1, kv_heads, cached + new, dim, generator=g).to(dtype)
    v = torch.randn(1, kv_heads, cached + new, dim, generator=g).to(dtype)
    qpos = torch.arange(cached, cached + new)[:, None]
    mask = torch.arange(cached + new)[None, :] <= qpos  # what AttentionMetadata builds
    return q, k, v, mask


@settings(max_examples=30, deadline=None)
@given(kv_heads=st.integers(1, 3), group=st.integers(1, 3), cached=st.integers(1, 80), new=st.integers(1, 80),
       dim=st.sampled_from([8, 32, 64]), scale=st.sampled_from([None, 0.3]), seed=st.integers(0, 2**31 - 1))
def test_equals_one_masked_call(kv_heads, group, cached, new, dim, scale, seed):
    q, k, v, mask = chunk(seed, kv_heads * group, kv_heads, cached, new, dim)
    got = attention._attend_after_cache(q, k, v, group > 1, scale)
    want = attention.attend(q, k, v, mask, group > 1, scale, None)
    assert got is not None and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_bfloat16_and_the_fallbacks():
    q, k, v, mask = chunk(1, 4, 2, 30, 20, 32, torch.bfloat16)
    got = attention._attend_after_cache(q, k, v, True, None)
    want = attention.attend(q.float(), k.float(), v.float(), mask, True, None, None)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
    assert attention._attend_after_cache(q.half(), k.half(), v.half(), True, None) is None


def test_the_cpu_backends_prefill_takes_it_for_a_chunk_after_cached_tokens(monkeypatch, r3srv_settings):
    """The CPU backend's torch prefill path (the Rust kernel off, or a context over its limit)
    merges; the torch path the other backends take masks, to the same tokens."""
    r3srv_settings(rust_prefill=False)
    calls = []
    original = attention._attend_after_cache
    monkeypatch.setattr(attention, "_attend_after_cache", lambda *a: calls.append(a[0].shape) or original(*a))
    from r3srv import LLM, SamplingParams

    llm = LLM(max_model_len=512, max_num_seqs=2, max_num_batched_tokens=64, enable_prefix_caching=False)
    model = llm.engine.core.executor.runner.model

    def generate():
        out = llm.generate([list(range(1, 150))], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
        return out[0].outputs[0].token_ids

    merged = generate()
    assert len(merged) == 2
    assert calls, "a 149-token prompt in 64-token chunks has chunks after cached tokens"
    calls.clear()
    model.select_ops(model.ops.replace(prefill_attention=attention.prefill_attention))  # the reference's
    assert generate() == merged and not calls

