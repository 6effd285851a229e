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
from r3srv.kernels.linear_cpu import BUILT, MAX_ROWS, linear_rust
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


def test_leading_dims_and_the_thread_split():
    x, w, b = operands(1, MAX_ROWS, 256, 1030, True)
    one = linear_rust(x.view(4, MAX_ROWS // 4, 256), w, b)
    assert one.shape == (4, MAX_ROWS // 4, 1030)
    # 32 x 1030 x 256 multiply-adds: two threads
    assert torch.equal(linear_rust(x.view(4, MAX_ROWS // 4, 256), w, b, threads=2), one)


@pytest.mark.parametrize("case", ["too many rows", "float16", "mixed dtypes", "strided weight", "strided x",
                                  "setting off", "bias shape", "empty"])
def test_falls_back_to_torch(case):
    x, w, b = operands(2, 3, 16, 8, True)
    args = {
        "too many rows": (torch.randn(MAX_ROWS + 1, 16), w, b),
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


def test_the_builtin_model_generates_the_same_tokens_and_rows_either_way(monkeypatch, llm):
    kernel_runs = []

    monkeypatch.setattr(linear_cpu, "linear_rust", counting(linear_rust, kernel_runs))
    prompts = [prompt_ids(5, 1), prompt_ids(17, 2), prompt_ids(40, 3)]
    # the decode steps' projections take the kernel; a 40-token prefill's have too many rows
    assert_same_outputs_either_way(llm, prompts, kernel_runs, "rust_linear", every_call=False)
    model = model_of(llm)
    assert model.layers[0].attn.qkv_proj.ops is model.ops  # the layers' one entry point
