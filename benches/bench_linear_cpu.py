"""Linear layers of a few rows on the CPU: the Rust kernel (r3srv.kernels.linear_cpu) against
torch's F.linear, as same-run ratios.

    .venv/bin/python -m pytest benches/bench_linear_cpu.py -s

(a) one call on the built-in model's decode shapes (q/k/v 256 -> 512, LM head 256 -> 259) at 1
    and 16 rows: benches/conftest.py prints torch / Rust as reference / r3srv (the weight is hot
    in the cache here, unlike in a step, where the experts' weights have evicted it);
(b) the built-in model's decode step of 1 and 16 sequences with the kernel on and off,
    interleaved round by round (bench_expert_pairs_cpu's interleaved_decode_steps): median
    thread-CPU and wall time per step, the same greedy tokens asserted;
(c) bfloat16 at prefill sizes (2,048 rows of the built-in model's q/k/v; 512 rows of a
    Qwen3-30B-A3B-sized one), where the kernel takes the call on a CPU without AMX or AVX-512
    BF16 (torch's bfloat16 GEMM there widens on the fly): torch / Rust, with the matrix kernel
    and the CPU's flags printed;
(d) float32 at prefill sizes (the built-in model's q/k/v, output and router projections of a
    2,048-token step), where the kernel's row tiles take the call on an AVX-512F CPU: torch /
    Rust, one thread, with the CPU's flags printed;
(e) a decode step's bfloat16 projections on Qwen3-30B-A3B's shapes (q/k/v, output and router of
    four layers, past the L3 between calls, as the experts leave them in a step) at 1 and 16
    rows: the weights' rows read in place / their packed copy (kernels/packed_weights.py), where
    the CPU reads one;
(f) the built-in model's float32 decode step of 48 sequences, float32 weights read in place by the
    kernel up to FLOAT32_MAX_ROWS rows or (as before) up to MAX_ROWS, torch's GEMM past them, at
    one and two threads, interleaved round by round: median thread-CPU and wall time per step,
    the same greedy tokens asserted, with the CPU's flags printed.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from bench_expert_pairs_cpu import decode_step_report, interleaved_decode_steps, modules_with
from r3srv import LLM, settings
from r3srv.ops import ops_for

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def linear_op(on: bool):
    """The CPU backend's linear op with the kernel on or off."""
    with settings.overridden(rust_linear=on):
        return ops_for("cpu", torch.float32).linear


@pytest.mark.parametrize("candidate", ["reference", "r3srv"])
@pytest.mark.parametrize("shape", [(1, 256, 512), (16, 256, 512), (1, 256, 259)], ids=lambda s: "x".join(map(str, s)))
def test_linear(benchmark, shape, candidate):
    rows, k, n = shape
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g) / 16
    benchmark.group = f"linear {'x'.join(map(str, shape))}"
    out = benchmark(linear_op(candidate == "r3srv"), x, w)
    torch.testing.assert_close(out, F.linear(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("candidate", ["reference", "r3srv"])
@pytest.mark.parametrize("shape", [(2048, 256, 512), (512, 2048, 1024)], ids=lambda s: "x".join(map(str, s)))
def test_linear_bfloat16_prefill(benchmark, shape, candidate, monkeypatch):
    from r3srv import _core
    from r3srv.kernels import cpu_isa, linear_cpu

    rows, k, n = shape
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(rows, k, generator=g).bfloat16(), (torch.randn(n, k, generator=g) / k**0.5).bfloat16()
    benchmark.group = f"linear bf16 {'x'.join(map(str, shape))}"
    monkeypatch.setattr(linear_cpu, "PACKED_BF16", True)
    out = benchmark(linear_op(candidate == "r3srv"), x, w)
    torch.testing.assert_close(out.float(), F.linear(x.float(), w.float()), rtol=2**-7, atol=1e-2)
    flags = sorted({"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16"} & cpu_isa.cpu_flags())
    print(f"\nmatrix kernel {_core.expert_pairs_isa()}; CPU flags {flags}; the server takes the kernel here: "
          f"{not cpu_isa.torch_has_fast_bfloat16()}")


@pytest.mark.parametrize("candidate", ["reference", "r3srv"])
@pytest.mark.parametrize("shape", [(2048, 256, 512), (2048, 256, 256), (2048, 256, 64)],
                         ids=lambda s: "x".join(map(str, s)))
def test_linear_float32_prefill(benchmark, shape, candidate):
    from r3srv.kernels import cpu_isa, linear_cpu

    if not linear_cpu.PACKED_F32:
        pytest.skip("no avx512f: float32 prefill projections stay with torch on this CPU")
    rows, k, n = shape
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g) / k**0.5
    benchmark.group = f"linear f32 {'x'.join(map(str, shape))}"
    out = benchmark(linear_op(candidate == "r3srv"), x, w)
    torch.testing.assert_close(out, F.linear(x, w), rtol=1e-5, atol=1e-5)
    flags = sorted({"avx2", "fma", "avx512f", "amx_bf16"} & cpu_isa.cpu_flags())
    print(f"\nCPU flags {flags}; the server takes the row tiles here: {linear_cpu.PACKED_F32}")


@pytest.mark.parametrize("num_seqs", [1, 16])
def test_decode_step(benchmark, num_seqs):
    llm = LLM(max_model_len=512, enable_prefix_caching=False, max_num_seqs=16)
    med = interleaved_decode_steps(benchmark, llm, num_seqs, modules_with(llm, rust_linear=None))
    print(f"\ndecode step, {num_seqs} sequence(s), median per step: thread CPU torch {med[False][0] * 1e3:.2f} ms, "
          f"Rust {med[True][0] * 1e3:.2f} ms, {med[False][0] / med[True][0]:.2f}x; wall "
          f"{med[False][1] / med[True][1]:.2f}x")


# Qwen3-30B-A3B's attention and router projections (out, in): q/k/v, output, router gate
QWEN3_PROJECTIONS = [(5120, 2048), (2048, 4096), (128, 2048)]


@pytest.mark.parametrize("candidate", ["reference", "r3srv"])
@pytest.mark.parametrize("rows", [1, 16])
def test_linear_packed(benchmark, rows, candidate):
    from r3srv.kernels import cpu_isa
    from r3srv.kernels.linear_cpu import linear_rust, packed_weight
    from r3srv.kernels.packed_weights import packs

    dtype = torch.bfloat16
    if not packs(dtype):
        pytest.skip("this CPU does not read bfloat16 weights packed (AVX-512 BF16 without AMX tiles)")
    from r3srv import huge_pages

    g = torch.Generator().manual_seed(0)

    def weight(n: int, k: int) -> torch.nn.Parameter:
        w = torch.empty(n, k, dtype=dtype)
        huge_pages.advise([w])  # as the loader leaves a model's weights (the packed copies are too)
        w.copy_(torch.randn(n, k, generator=g) / k**0.5)
        return torch.nn.Parameter(w, requires_grad=False)

    weights = [weight(n, k) for _ in range(4) for n, k in QWEN3_PROJECTIONS]
    xs = {k: torch.randn(rows, k, generator=g).to(dtype) for _, k in QWEN3_PROJECTIONS}
    pack = candidate == "r3srv"
    for w in weights:
        assert packed_weight(w) is not None  # made before the timing

    def step():
        return [linear_rust(xs[w.shape[1]], w, None, 1, pack) for w in weights]

    benchmark.group = f"linear packed bfloat16 {rows} rows"
    outs = benchmark(step)
    for w, out in zip(weights[:3], outs):
        x = xs[w.shape[1]]
        torch.testing.assert_close(out.double(), x.double() @ w.double().T, rtol=2**-7, atol=1e-3)
    flags = sorted({"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16"} & cpu_isa.cpu_flags())
    print(f"\nCPU flags {flags}; bfloat16 weights read packed here: {packs(dtype)}")


@pytest.mark.parametrize("threads", [1, 2])
def test_float32_decode_steps_past_32_sequences(benchmark, threads):
    from r3srv.kernels import cpu_isa, linear_cpu

    with settings.overridden(cpu_threads=threads):
        llm = LLM(dtype="float32", max_model_len=512, enable_prefix_caching=False, max_num_seqs=64)

    @contextlib.contextmanager
    def float32_row_limit(on: bool):
        limit = linear_cpu.FLOAT32_MAX_ROWS
        linear_cpu.FLOAT32_MAX_ROWS = limit if on else linear_cpu.MAX_ROWS
        try:
            yield
        finally:
            linear_cpu.FLOAT32_MAX_ROWS = limit

    med = interleaved_decode_steps(benchmark, llm, 48, float32_row_limit)
    print(decode_step_report(med, 48, off=f"kernel to {linear_cpu.MAX_ROWS} rows",
                             on=f"kernel to {linear_cpu.FLOAT32_MAX_ROWS} rows"))
    flags = sorted({"avx2", "fma", "avx512f"} & cpu_isa.cpu_flags())
    print(f"CPU flags {flags}; kernel threads {threads}")
    llm.engine.shutdown()
