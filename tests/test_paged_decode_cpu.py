"""The CPU paged decode attention kernel (kernels/paged_decode_cpu.py, rust/src/paged_attn.rs)
against the torch path (gather + SDPA) on generated inputs, its input checks, the CPU backend
taking it, its wiring into the models, and the engine's tokens and routed experts with it on
and off."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from paged_decode_testing import MODEL_CASES, paged_cache, torch_path_decode, two_sequence_decode_logits

from engine_testing import GREEDY, model_of, one_torch_thread, prompt_ids, rebound  # noqa: F401 (autouse fixture)
from r3srv import LLM, SamplingParams, _core
from r3srv import settings as settings_module
from r3srv.kernels import cpu_isa
from r3srv.kernels import paged_decode_cpu as cpu_kernel
from r3srv.kernels.paged_decode_cpu import paged_decode_cpu as kernel
from r3srv.ops import ops_for

PAGE = 4
LENS = [1, 3, 4, 33, 70, 9, 130]  # one key, a block's worth, across blocks and tiles of 32


def run_case(heads, kv_heads, head_dim, v_dim, window, sinks, seed, dtype=torch.float32, lens=LENS, latent=False,
             threads=1):
    """The kernel's rows and the torch path's for sequences at scattered rows of a step (the
    rows of other tokens must keep their -7)."""
    g = torch.Generator().manual_seed(seed)
    k_cache, v_cache, tables = paged_cache(lens, kv_heads, head_dim, max(v_dim, head_dim) if latent else v_dim, g,
                                           dtype, PAGE)
    if latent:  # MLA: the values are the leading dims of the cached keys
        v_cache = k_cache[..., :v_dim]
    t = len(lens) + 2
    rows = torch.randperm(t, generator=g)[: len(lens)]
    q = torch.randn(t, heads, head_dim, generator=g).to(dtype)
    sink = torch.randn(heads, generator=g) if sinks else None
    scale = head_dim**-0.5 * 1.3
    out = torch.full((t, heads, v_dim), -7.0, dtype=dtype)
    kernel(q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32), rows, out, page=PAGE, scale=scale,
           window=window, sinks=sink, threads=threads)
    up = (lambda x: x.float()) if dtype != torch.float32 else (lambda x: x)
    want = torch_path_decode(up(q), up(k_cache), up(v_cache), tables, lens, rows.tolist(), scale, window, sink, PAGE)
    others = [r for r in range(t) if r not in rows.tolist()]
    assert (out[others] == -7.0).all()
    return up(out[rows]), want[rows]


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 4), (8, 2), (6, 2), (16, 1)])
@pytest.mark.parametrize("head_dim, v_dim", [(64, 64), (13, 13), (24, 40)])
@pytest.mark.parametrize("window, sinks", [(None, False), (5, False), (None, True), (40, True)],
                         ids=["plain", "window", "sinks", "window-sinks"])
def test_decode_attention_equals_the_torch_path(heads, kv_heads, head_dim, v_dim, window, sinks):
    got, want = run_case(heads, kv_heads, head_dim, v_dim, window, sinks, seed=heads * 100 + head_dim + (window or 0))
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("heads", [16, 20])
def test_latent_decodes_equal_the_torch_path(heads):
    """MLA's latent decodes: one "KV head" for all heads, the values a view of its leading dims
    (row stride that of the keys)."""
    got, want = run_case(heads, 1, 40, 32, None, False, seed=heads, latent=True)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_bfloat16_accumulates_in_float32():
    got, want = run_case(8, 2, 32, 32, None, True, seed=3, dtype=torch.bfloat16)
    torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)  # one bfloat16 rounding of the output


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(16, 2, 128), (32, 4, 64), (12, 1, 24), (20, 1, 40)])
@pytest.mark.parametrize("window, sinks", [(None, False), (40, True)], ids=["plain", "window-sinks"])
@pytest.mark.parametrize("latent", [False, True], ids=["kv", "latent"])
def test_bfloat16_groups_of_eight_equal_the_torch_path(heads, kv_heads, head_dim, window, sinks, latent):
    """bfloat16 GQA groups of eight heads or more, which an AVX-512 BF16 CPU scores in dot
    products (`_core.paged_decode_isa()` "avx512_bf16"; groups of 12 and 20: a block of eight or
    two, the rest widened), MLA-like latent values too, against gather + SDPA in float32."""
    lens = [1, 9, 300, 64]
    got, want = run_case(heads, kv_heads, head_dim, head_dim - 8 if latent else head_dim, window, sinks,
                         seed=heads + head_dim, dtype=torch.bfloat16, lens=lens, latent=latent)
    torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)  # one bfloat16 rounding of the output


def test_threads_split_the_work_to_the_same_result():
    """On two threads 16 sequences of 300 keys are split between them: the same rows."""
    results = [run_case(4, 2, 64, 64, None, False, seed=7, lens=[300] * 16, threads=threads) for threads in (1, 2)]
    (one, want), (two, _) = results
    torch.testing.assert_close(one, want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(two, one, atol=0, rtol=0)


def small_inputs():
    g = torch.Generator().manual_seed(0)
    k_cache, v_cache, tables = paged_cache([5, 3], 2, 8, 8, g, page=PAGE)
    q = torch.randn(2, 4, 8, generator=g)
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, tables=tables, lens=torch.tensor([5, 3]),
                rows=torch.tensor([0, 1]), out=torch.empty(2, 4, 8))


@pytest.mark.parametrize("changed, error, match", [
    (lambda a: dict(q=a["q"].half(), out=a["out"].half()), TypeError, "float32 or bfloat16"),
    (lambda a: dict(out=a["out"].double()), TypeError, "every tensor must be"),
    (lambda a: dict(q=a["q"].transpose(1, 2).contiguous().transpose(1, 2)), ValueError, "contiguous in its last dim"),
    (lambda a: dict(out=a["out"].transpose(0, 1).contiguous().transpose(0, 1)), ValueError, "out must be contiguous"),
    (lambda a: dict(out=a["q"]), ValueError, "shares memory with q"),
    (lambda a: dict(rows=torch.tensor([1, 1])), ValueError, "same output row"),
    (lambda a: dict(rows=torch.tensor([0, 2])), ValueError, "outside the 2 query rows"),
    (lambda a: dict(lens=torch.tensor([5, 9])), ValueError, "context length 9"),
    (lambda a: dict(tables=torch.tensor([[0, 99], [1, 0]])), ValueError, "block 99"),
    (lambda a: dict(tables=torch.tensor([[0, -1], [1, 0]])), ValueError, "block -1"),
    (lambda a: dict(lens=torch.tensor([5])), ValueError, "do not describe 2 sequences"),
])
def test_bad_inputs_are_typed_errors(changed, error, match):
    args = small_inputs()
    args.update(changed(args))
    with pytest.raises(error, match=match):
        kernel(*args.values(), page=PAGE, scale=0.3)


def test_bad_sinks_and_window_are_value_errors():
    args = small_inputs()
    with pytest.raises(ValueError, match="sinks for 4 heads"):
        kernel(*args.values(), page=PAGE, scale=0.3, sinks=torch.zeros(3))
    with pytest.raises(ValueError, match="window must be positive"):
        kernel(*args.values(), page=PAGE, scale=0.3, window=0)


def test_cpu_decodes_take_the_kernel_unless_turned_off():
    assert cpu_kernel.BUILT, "r3srv._core lacks the paged decode kernel: rebuild the extension (make install)"
    flags = cpu_isa.cpu_flags()
    widest = (
        "avx512_bf16"
        if {"avx512f", "avx512_bf16", "avx512vl"} <= flags
        else "avx512"
        if "avx512f" in flags
        else "avx2"
        if {"avx2", "fma"} <= flags
        else "portable"
    )
    assert _core.paged_decode_isa() == widest

    def decode_kernel(dtype, **switches):
        with settings_module.overridden(**switches):
            return ops_for("cpu", dtype).decode_attention

    for dtype in (torch.float32, torch.bfloat16):
        chosen = decode_kernel(dtype, cpu_threads=3)
        assert chosen.func is cpu_kernel.paged_decode_cpu and chosen.keywords == {"threads": 3}
    assert decode_kernel(torch.float16) is None  # float16: the torch path
    assert decode_kernel(torch.float32, rust_decode=False) is None


def counting_kernel(monkeypatch) -> list:
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(cpu_kernel, "paged_decode_cpu", counted)
    return calls


@pytest.mark.parametrize("family, layers", MODEL_CASES)
def test_models_decode_through_the_kernel(family, layers, monkeypatch, tmp_path):
    """The wiring: decode steps (after a prefill; GQA, gpt-oss's sinks and windows, Mixtral's
    window, latent attention) through the kernel give the logits of the gathered torch path."""
    from tiny_checkpoints import write_tiny_checkpoint

    from r3srv.models.loader import load_model

    model, _ = load_model(write_tiny_checkpoint(tmp_path / family, family, seed=4, **layers))
    calls = counting_kernel(monkeypatch)
    with rebound(model, fast_cpu_decode=False, rust_decode=False):
        off = two_sequence_decode_logits(model)
    assert not calls
    with rebound(model, fast_cpu_decode=False, rust_decode=True):
        torch.testing.assert_close(two_sequence_decode_logits(model), off, atol=1e-5, rtol=1e-5)
    assert calls, "the decodes never took the kernel"


def test_a_bfloat16_model_with_groups_of_eight_decodes_through_the_kernel(monkeypatch, tmp_path):
    """A bfloat16 Qwen3-MoE with Qwen3-30B-A3B's GQA group of eight (16 query heads over 2 KV
    heads, head_dim 64), whose decodes an AVX-512 BF16 CPU scores in dot products: its decode
    logits through the kernel against the gathered torch path's, within bfloat16 rounding."""
    from tiny_checkpoints import write_tiny_checkpoint

    from r3srv.models.loader import load_model

    path = write_tiny_checkpoint(tmp_path / "gqa8", "qwen3_moe", seed=5, num_attention_heads=16,
                                 num_key_value_heads=2, head_dim=64)
    model, _ = load_model(path, dtype=torch.bfloat16)
    calls = counting_kernel(monkeypatch)
    with rebound(model, fast_cpu_decode=False, rust_decode=False):
        off = two_sequence_decode_logits(model)
    with rebound(model, fast_cpu_decode=False, rust_decode=True):
        on = two_sequence_decode_logits(model)
    assert calls, "the decodes never took the kernel"
    torch.testing.assert_close(on.float(), off.float(), atol=3e-2, rtol=3e-2)


def test_engine_tokens_and_routed_experts_equal_the_torch_path(monkeypatch):
    """The built-in model's greedy tokens and routed-experts rows, with decodes through the
    kernel and through gather + SDPA, for prompts of several lengths decoding together."""
    llm = LLM(max_model_len=256, max_num_seqs=8, enable_prefix_caching=False)
    prompts = [prompt_ids(3, 1), prompt_ids(40, 2), prompt_ids(17, 3), prompt_ids(90, 4)]
    params = SamplingParams(max_tokens=24, **GREEDY)
    calls = counting_kernel(monkeypatch)
    with rebound(model_of(llm), fast_cpu_decode=False, rust_decode=False):
        off = llm.generate(prompts, params)
    assert not calls
    with rebound(model_of(llm), fast_cpu_decode=False, rust_decode=True):
        on = llm.generate(prompts, params)
    assert calls
    for a, b in zip(off, on):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        np.testing.assert_array_equal(b.outputs[0].routed_experts, a.outputs[0].routed_experts)
