"""An attention layer's q/k norms and RoPE on the CPU: the Rust kernel (r3srv.kernels.qk_rope_cpu)
against the torch ops, as same-run ratios.

    .venv/bin/python -m pytest benches/bench_qk_rope_cpu.py -s

(a) one layer's heads from the built-in model's fused projection (4 query heads, 2 KV heads of
    64, Qwen3's per-head norms, full rotary) at 1 and 16 tokens: benches/conftest.py prints
    torch / Rust as reference / r3srv;
(b) a 2,048-token prefill's layer in float32 and bfloat16, the Rust kernel on 1 and 2 threads
    against the torch ops on as many torch threads;
(c) the built-in model's decode step of 1 and 16 sequences with the kernel on and off,
    interleaved round by round (bench_expert_pairs_cpu's interleaved_decode_steps): median
    thread-CPU and wall time per step, the same greedy tokens asserted.
"""

from __future__ import annotations

import pytest
import torch

from bench_expert_pairs_cpu import interleaved_decode_steps, modules_with
from r3srv import LLM
from r3srv.kernels.qk_rope_cpu import qk_norm_rope
from r3srv.ops.norm import rms_norm
from r3srv.ops.rotary import apply_rope, rope_cos_sin, rope_inv_freq

pytestmark = pytest.mark.usefixtures("one_torch_thread")
HEADS, KV_HEADS, DIM = 4, 2, 64


def torch_heads(qkv, norms, eps, cos, sin):
    """The torch ops models/model.py's Attention runs without the kernel."""
    t = qkv.shape[0]
    q, k, v = qkv.split([HEADS * DIM, KV_HEADS * DIM, KV_HEADS * DIM], dim=-1)
    q, k, v = q.reshape(t, HEADS, DIM), k.reshape(t, KV_HEADS, DIM), v.reshape(t, KV_HEADS, DIM)
    q, k = rms_norm(q, norms[0], eps), rms_norm(k, norms[1], eps)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v.contiguous()


@pytest.mark.parametrize("candidate", ["reference", "r3srv"])
@pytest.mark.parametrize("tokens", [1, 16])
def test_layer_heads(benchmark, tokens, candidate):
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * DIM, generator=g)
    norms = (torch.rand(DIM, generator=g) + 0.5, torch.rand(DIM, generator=g) + 0.5)
    cos, sin = rope_cos_sin(torch.arange(100, 100 + tokens), rope_inv_freq(DIM, 1e6), torch.float32)
    benchmark.group = f"q/k norms + RoPE, {tokens} token(s)"
    if candidate == "r3srv":
        got = benchmark(qk_norm_rope, qkv, HEADS, KV_HEADS, DIM, norms, 1e-6, cos, sin)
    else:
        got = benchmark(torch_heads, qkv, norms, 1e-6, cos, sin)
    for a, b in zip(got, torch_heads(qkv, norms, 1e-6, cos, sin)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("candidate", ["reference", "r3srv"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_prefill_heads(benchmark, dtype, threads, candidate):
    tokens = 2048
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * DIM, generator=g).to(dtype)
    norms = ((torch.rand(DIM, generator=g) + 0.5).to(dtype), (torch.rand(DIM, generator=g) + 0.5).to(dtype))
    cos, sin = rope_cos_sin(torch.arange(tokens), rope_inv_freq(DIM, 1e6), dtype)
    benchmark.group = f"q/k norms + RoPE, {tokens} tokens, {str(dtype)[6:]}, {threads} thread(s)"
    torch.set_num_threads(threads)  # one_torch_thread restores it
    if candidate == "r3srv":
        got = benchmark(qk_norm_rope, qkv, HEADS, KV_HEADS, DIM, norms, 1e-6, cos, sin, threads=threads)
    else:
        got = benchmark(torch_heads, qkv, norms, 1e-6, cos, sin)
    tolerance = 1e-5 if dtype is torch.float32 else 2**-6  # bfloat16: a norm's sum may round one step apart
    for a, b in zip(got, torch_heads(qkv, norms, 1e-6, cos, sin)):
        torch.testing.assert_close(a.float(), b.float(), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("num_seqs", [1, 16])
def test_decode_step(benchmark, num_seqs):
    llm = LLM(max_model_len=512, enable_prefix_caching=False, max_num_seqs=16)
    med = interleaved_decode_steps(benchmark, llm, num_seqs, modules_with(llm, rust_rope=None))
    print(f"\ndecode step, {num_seqs} sequence(s), median per step: thread CPU torch {med[False][0] * 1e3:.2f} ms, "
          f"Rust {med[True][0] * 1e3:.2f} ms, {med[False][0] / med[True][0]:.2f}x; wall "
          f"{med[False][1] / med[True][1]:.2f}x")
