"""Bfloat16 linear layers' weights kept packed (kernels/packed_weights.py, read by
kernels/linear_cpu.py with pack=True, in the AVX-512 BF16 dot products' panels): on generated
shapes and values, within bfloat16 rounding of torch's float64 product, a row's result its own and
the same on any thread count; the copy follows the parameter (in-place updates, moves, deletion);
weights that are not parameters, and float32 weights, are read in place; the CPU backend's op and
the fused decode layers of the built-in model read the copy, and not with --no-packed-linear."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_testing import model_of, one_torch_thread, prompt_ids  # noqa: F401 (autouse fixture)
from r3srv import LLM, SamplingParams
from r3srv import settings as settings_module
from r3srv.kernels import linear_cpu, packed_weights
from r3srv.kernels.linear_cpu import BUILT, MAX_ROWS, PACKED_MAX_ROWS, linear_rust, packed_weight
from r3srv.kernels.packed_weights import packed_copy, packs
from r3srv.ops import ops_for

pytestmark = pytest.mark.skipif(not (BUILT and packs(torch.bfloat16)), reason="this CPU lacks AVX-512 BF16, or its "
                                "wide bfloat16 chunks run in AMX tiles: bfloat16 weights are not packed here")
BF16 = torch.bfloat16


def parameter(seed: int, n: int, k: int, dtype: torch.dtype = BF16) -> torch.nn.Parameter:
    g = torch.Generator().manual_seed(seed)
    return torch.nn.Parameter((torch.randn(n, k, generator=g) / k**0.5).to(dtype), requires_grad=False)


def rows_of(seed: int, m: int, k: int, dtype: torch.dtype = BF16) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype)


def assert_near_float64(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    """float32 sums of the bfloat16 values, rounded once to bfloat16."""
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    torch.testing.assert_close(got.double(), want, rtol=2**-8, atol=1e-5)


@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, PACKED_MAX_ROWS), k=st.integers(1, 300), n=st.integers(1, 300), bias=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_a_packed_weight_gives_the_product_and_each_row_its_own(m, k, n, bias, seed):
    w, x = parameter(seed, n, k), rows_of(seed + 1, m, k)
    b = rows_of(seed + 2, 1, n)[0] if bias else None
    got = linear_rust(x, w, b, pack=True)
    assert got is not None and got.shape == (m, n) and got.dtype == BF16
    assert packed_weight(w) == packed_copy(w).data_ptr()  # read packed
    assert_near_float64(got, x, w, b)
    for r in {0, m - 1}:  # a row alone has its bits in the batch
        assert torch.equal(linear_rust(x[r : r + 1], w, b, pack=True)[0], got[r])
    assert torch.equal(linear_rust(x, w, b, threads=2, pack=True), got)


def test_a_decode_steps_rows_split_over_threads_and_leading_dims():
    """16 rows x 1,030 outputs x 256: split over three threads in whole panels, the same bits."""
    w, x = parameter(3, 1030, 256), rows_of(4, 16, 256)
    one = linear_rust(x.view(2, 8, 256), w, pack=True)
    assert one.shape == (2, 8, 1030)
    assert torch.equal(linear_rust(x, w, threads=3, pack=True), one.view(16, 1030))
    assert_near_float64(one.view(16, 1030), x, w, None)


def test_the_copy_follows_the_parameter():
    w, x = parameter(8, 70, 64), rows_of(9, 3, 64)
    first = packed_copy(w)
    assert first is not None and packed_copy(w) is first  # kept, not made again
    before = linear_rust(x, w, pack=True)
    with torch.no_grad():
        w.mul_(2.0)  # a weight update in place: its version moves
    assert packed_copy(w) is first  # packed again into the copy it has (no fresh pages)
    assert_near_float64(linear_rust(x, w, pack=True), x, w, None)
    assert torch.equal(linear_rust(x, w, pack=True), 2 * before)  # a power of two: exact
    w.data = parameter(10, 70, 64).data  # new storage
    assert_near_float64(linear_rust(x, w, pack=True), x, w, None)
    w.data = parameter(11, 130, 64).data  # another shape: a copy of its own
    assert packed_copy(w) is not first and packed_copy(w).numel() > first.numel()
    assert_near_float64(linear_rust(x, w, pack=True), x, w, None)
    copy = weakref.ref(packed_copy(w))
    key = id(w)
    del w
    gc.collect()
    assert copy() is None and key not in packed_weights._PACKED  # dropped with the parameter


def test_a_packed_weight_takes_the_kernel_up_to_its_own_row_limit():
    """Past MAX_ROWS rows torch takes a weight read in place (where it has fast bfloat16), the
    kernel a packed one, up to PACKED_MAX_ROWS."""
    w = parameter(17, 64, 32)
    for rows in (MAX_ROWS + 1, PACKED_MAX_ROWS):
        x = rows_of(rows, rows, 32)
        assert linear_rust(x, w, pack=True) is not None
        assert (linear_rust(x, w) is None) == (not linear_cpu.PACKED_BF16)
    assert (linear_rust(rows_of(18, PACKED_MAX_ROWS + 1, 32), w, pack=True) is None) == (not linear_cpu.PACKED_BF16)


def test_weights_that_are_not_parameters_are_read_in_place():
    w, x = parameter(11, 40, 32), rows_of(12, 2, 32)
    plain = w.data
    assert packed_weight(plain) is None
    assert torch.equal(linear_rust(x, plain, pack=True), linear_rust(x, plain))


def test_float32_weights_keep_the_lanes_sums():
    """A float32 weight is not read packed by the linear kernel (one chain over K would round
    more): the same bits as without pack."""
    w, x = parameter(13, 300, 256, torch.float32), rows_of(14, 16, 256, torch.float32)
    assert packed_weight(w) is None
    assert torch.equal(linear_rust(x, w, pack=True), linear_rust(x, w))


def test_the_backend_op_reads_packed_weights_unless_told_not_to(monkeypatch):
    calls = []
    monkeypatch.setattr(linear_cpu, "linear_entry", lambda *args: calls.append(args[5]))
    w, x = parameter(15, 8, 16), rows_of(16, 2, 16)
    ops_for("cpu", BF16).linear(x, w)
    assert calls[-1] == packed_copy(w).data_ptr()
    with settings_module.overridden(packed_linear=False):
        ops_for("cpu", BF16).linear(x, w)
    assert calls[-1] is None


@pytest.mark.parametrize("on", [True, False])
def test_the_fused_decode_layers_read_what_the_backend_reads(monkeypatch, on):
    """A bfloat16 model's decode steps (fused layers): every projection and router gate call
    passes its weight's packed copy, or none with --no-packed-linear."""
    with settings_module.overridden(packed_linear=on):
        llm = LLM(dtype="bfloat16", max_model_len=128, max_num_seqs=2, enable_prefix_caching=False)
    model = model_of(llm)
    assert all(layer.fused is not None for layer in model.layers)
    entry, seen = linear_cpu.linear_entry, []

    def spy(addresses, shape, dtype, threads, isa=None, packed=None):
        seen.append((addresses[1], packed))
        return entry(addresses, shape, dtype, threads, isa, packed)

    monkeypatch.setattr(linear_cpu, "linear_entry", spy)
    llm.generate([prompt_ids(7, 1), prompt_ids(9, 2)], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    weights = {p.data_ptr(): p for p in model.parameters()}
    layer_weights = {w for w, _ in seen if w in weights and weights[w].dim() == 2}
    assert len(layer_weights) >= 3 * len(model.layers)  # q/k/v, output and router gate of every layer
    for w, packed in seen:
        assert packed == (packed_copy(weights[w]).data_ptr() if on else None)
    llm.engine.shutdown()
