"""The Rust linear kernel for a few rows (r3srv.kernels.linear_cpu) against torch's F.linear on
generated inputs, its fallbacks, its thread split, the CPU backend's linear op with it on and
off, and the built-in model's tokens and routed experts with it on and off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_testing import assert_same_outputs_either_way, counting, model_of, one_torch_thread, prompt_ids  # noqa: F401 (autouse fixture)
from r3srv import LLM
from r3srv import settings as settings_module
from r3srv.kernels import linear_cpu
from r3srv.kernels.linear_cpu import BUILT, FLOAT32_MAX_ROWS, MAX_ROWS, linear_rust
from r3srv.ops import ops_for


def operands(seed: int, rows: int, k: int, n: int, bias: bool, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g) / k**0.5
    b = torch.randn(n, generator=g) if bias else None
    return x.to(dtype), w.to(dtype), None if b is None else b.to(dtype)


def test_this_build_has_the_kernel():
    assert BUILT, "r3srv._core predates the linear kernel: rebuild the extension"


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, MAX_ROWS), k=st.integers(1, 300), n=st.integers(1, 300), bias=st.booleans(),
       bfloat16=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_equals_f_linear(rows, k, n, bias, bfloat16, seed):
    x, w, b = operands(seed, rows, k, n, bias, torch.bfloat16 if bfloat16 else torch.float32)
    got = linear_rust(x, w, b)
    assert got is not None and got.shape == (rows, n) and got.dtype == x.dtype
    if bfloat16:  # float32 arithmetic, rounded once; torch's may round more often
        want = F.linear(x.float(), w.float(), None if b is None else b.float())
        torch.testing.assert_close(got.float(), want, rtol=2**-7, atol=1e-2)
    else:
        torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    for r in {0, rows - 1}:  # a row's result does not depend on the others
        alone = linear_rust(x[r : r + 1], w, b)
        assert torch.equal(alone[0], got[r])


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(MAX_ROWS + 1, FLOAT32_MAX_ROWS), k=st.integers(1, 300), n=st.integers(1, 300),
       bias=st.booleans(), threads=st.integers(1, 3), seed=st.integers(0, 2**31 - 1))
def test_float32_takes_the_kernel_up_to_its_own_row_limit(rows, k, n, bias, threads, seed):
    """float32 weights read in place take the per-row products past MAX_ROWS, to FLOAT32_MAX_ROWS
    rows (bfloat16 ones stop at MAX_ROWS: test_many_bfloat16_rows_keep_torch_...): within float32
    rounding of F.linear, a row's bits its own at any thread count (one row more: test_falls_back_to_torch)."""
    x, w, b = operands(seed, rows, k, n, bias)
    got = linear_rust(x, w, b, threads=threads)
    assert got is not None and got.shape == (rows, n)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    for r in {0, rows // 2, rows - 1}:
        assert torch.equal(linear_rust(x[r : r + 1], w, b)[0], got[r])


def test_leading_dims_and_the_thread_split():
    x, w, b = operands(1, MAX_ROWS, 256, 1030, True)
    one = linear_rust(x.view(4, MAX_ROWS // 4, 256), w, b)
    assert one.shape == (4, MAX_ROWS // 4, 1030)
    # 32 x 1030 x 256 multiply-adds: two threads
    assert torch.equal(linear_rust(x.view(4, MAX_ROWS // 4, 256), w, b, threads=2), one)


@pytest.mark.parametrize("rows", [MAX_ROWS + 1, 64, 300])
def test_many_bfloat16_rows_run_packed_within_rounding_on_any_thread_count(monkeypatch, rows):
    monkeypatch.setattr(linear_cpu, "PACKED_BF16", True)  # as on a CPU without AMX or AVX-512 BF16
    x, w, b = operands(rows, rows, 200, 300, True, torch.bfloat16)
    got = linear_rust(x, w, b)
    assert got is not None and got.dtype == torch.bfloat16 and got.shape == (rows, 300)
    # float32 arithmetic on the bfloat16 values, rounded once
    want = F.linear(x.float(), w.float(), b.float())
    torch.testing.assert_close(got.float(), want, rtol=2**-8, atol=1e-4)
    with settings_module.overridden(cpu_threads=2):
        assert torch.equal(linear_rust(x, w, b), got)


def test_many_bfloat16_rows_keep_torch_where_it_has_fast_bfloat16(monkeypatch):
    monkeypatch.setattr(linear_cpu, "PACKED_BF16", False)  # as with AMX or AVX-512 BF16
    x, w, b = operands(3, MAX_ROWS + 1, 16, 8, True, torch.bfloat16)
    assert linear_rust(x, w, b) is None
    assert linear_rust(x[:MAX_ROWS], w, b) is not None


def test_the_packed_bfloat16_choice_follows_the_cpu_flags(monkeypatch):
    from r3srv.kernels import cpu_isa

    assert linear_cpu.PACKED_BF16 == (not {"amx_bf16", "avx512_bf16"} & cpu_isa.cpu_flags())
    monkeypatch.setattr(cpu_isa, "cpu_flags", lambda: frozenset({"avx2", "avx512f", "amx_bf16"}))
    assert cpu_isa.torch_has_fast_bfloat16()
    monkeypatch.setattr(cpu_isa, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    assert not cpu_isa.torch_has_fast_bfloat16()


def test_the_float32_row_tiles_follow_the_cpu_flags():
    from r3srv.kernels import cpu_isa

    assert linear_cpu.PACKED_F32 == ("avx512f" in cpu_isa.cpu_flags())


@pytest.mark.skipif(not linear_cpu.PACKED_F32, reason="no avx512f: the float32 row tiles do not run on this CPU")
@pytest.mark.parametrize("rows,n", [(linear_cpu.ROW_TILES_MIN_ROWS, 130), (1100, 64), (2049, 7)])
def test_many_float32_rows_run_in_the_row_tiles_on_any_thread_count(rows, n):
    """Each element is one multiply-add chain over k in order (Rust's tests check the bits):
    within float32 rounding of the float64 product, and the same bits on one or two threads."""
    x, w, b = operands(rows + n, rows, 256, n, True)
    got = linear_rust(x, w, b)
    assert got is not None and got.dtype == torch.float32 and got.shape == (rows, n)
    torch.testing.assert_close(got.double(), F.linear(x.double(), w.double(), b.double()), rtol=1e-5, atol=1e-5)
    assert torch.equal(linear_rust(x, w, b, threads=2), got)


def test_float32_rows_under_the_row_tiles_threshold_keep_torch():
    x, w, b = operands(5, linear_cpu.ROW_TILES_MIN_ROWS - 1, 16, 8, True)
    assert linear_rust(x, w, b) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_matrix_kernel_this_cpu_runs_gives_the_avx2_bits(dtype):
    """The AVX-512 kernel holds two weight rows per register in the AVX2 kernel's lane order:
    the same bits, checked wherever the CPU runs it."""
    from r3srv import _core

    isas = _core.matrix_isas()
    assert isas[0] == "scalar"
    if "avx2" not in isas:
        pytest.skip("no avx2 + fma: only the portable kernel runs here")
    if "avx512" not in isas:
        pytest.skip("no avx512f: the AVX-512 kernel is not run on this CPU")
    for rows, k, n in [(1, 256, 512), (3, 40, 13), (16, 100, 259), (32, 8, 7), (64, 96, 130)]:
        x, w, b = operands(rows + k, rows, k, n, True, dtype)
        outs = {}
        for isa in ("avx2", "avx512"):
            out = torch.empty(rows, n, dtype=dtype)
            _core.linear_cpu((x.data_ptr(), w.data_ptr(), b.data_ptr(), out.data_ptr()), (rows, n, k),
                             linear_cpu.RUST_DTYPES[dtype], 1, isa)
            outs[isa] = out
        assert torch.equal(outs["avx512"], outs["avx2"]), (rows, k, n)


def test_a_matrix_kernel_this_cpu_lacks_is_a_value_error():
    from r3srv import _core

    x, w, _ = operands(4, 1, 8, 4, False)
    out = torch.empty(1, 4)
    with pytest.raises(ValueError, match='runs no matrix kernel "avx1024"'):
        _core.linear_cpu((x.data_ptr(), w.data_ptr(), 0, out.data_ptr()), (1, 4, 8), "float32", 1, "avx1024")


@pytest.mark.parametrize("case", ["too many rows", "float16", "mixed dtypes", "strided weight", "strided x",
                                  "setting off", "bias shape", "empty"])
def test_falls_back_to_torch(case):
    x, w, b = operands(2, 3, 16, 8, True)
    args = {
        "too many rows": (torch.randn(FLOAT32_MAX_ROWS + 1, 16), w, b),
        "float16": (x.half(), w.half(), b.half()),
        "mixed dtypes": (x, w.bfloat16(), b),
        "strided weight": (x, torch.cat([w, w], dim=1)[:, ::2], b),
        "strided x": (torch.cat([x, x], dim=1)[:, ::2], w, b),
        "setting off": (x, w, b),
        "bias shape": (x, w, b[:4]),
        "empty": (x[:0], w, b),
    }[case]
    with settings_module.overridden(rust_linear=case != "setting off"):
        linear = ops_for("cpu", torch.float32).linear  # the CPU backend's op, chosen under these settings
    if case == "setting off":
        assert linear is F.linear
    else:
        assert linear_rust(*args) is None
    if case not in ("bias shape", "mixed dtypes"):  # F.linear refuses those itself
        torch.testing.assert_close(linear(*args), F.linear(*args), rtol=0, atol=0)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_model_len=256, max_num_seqs=4, enable_prefix_caching=False)


@pytest.mark.skipif(not linear_cpu.PACKED_F32, reason="no avx512f: the float32 row tiles do not run on this CPU")
def test_a_long_float32_prompt_generates_the_same_tokens_and_rows_with_the_row_tiles(monkeypatch):
    """A prefill of more than ROW_TILES_MIN_ROWS tokens runs its projections in the row tiles:
    the same greedy tokens and routed-experts rows as torch's GEMM gives."""
    long_llm = LLM(dtype="float32", max_model_len=1280, max_num_seqs=1, enable_prefix_caching=False)
    tiled = []

    def spy(x, weight, bias=None, threads=1, pack=False):
        out = linear_rust(x, weight, bias, threads, pack)
        tiled.append(out is not None and x.numel() // x.shape[-1] >= linear_cpu.ROW_TILES_MIN_ROWS)
        return out

    monkeypatch.setattr(linear_cpu, "linear_rust", spy)
    assert_same_outputs_either_way(long_llm, [prompt_ids(1100, 4)], tiled, "rust_linear", every_call=False)
    long_llm.engine.shutdown()


def test_the_builtin_model_generates_the_same_tokens_and_rows_either_way(monkeypatch, llm):
    kernel_runs = []

    monkeypatch.setattr(linear_cpu, "linear_rust", counting(linear_rust, kernel_runs))
    prompts = [prompt_ids(5, 1), prompt_ids(17, 2), prompt_ids(40, 3)]
    # the decode steps' projections take the kernel; a 40-token prefill's have too many rows
    assert_same_outputs_either_way(llm, prompts, kernel_runs, "rust_linear", every_call=False)
    model = model_of(llm)
    assert model.layers[0].attn.qkv_proj.ops is model.ops  # the layers' one entry point
