"""RMSNorm on the CPU: the Rust kernel (r3srv.kernels.rms_norm_cpu) against torch's rms_norm,
as same-run ratios.

    .venv/bin/python -m pytest benches/bench_rms_norm_cpu.py -s

(a) one call on a decode step's shapes (a 1 x 256 row, Qwen3's per-head q/k norm on 1 x 4 x 64,
    16 x 256 rows): benches/conftest.py prints torch / Rust as reference / r3srv;
(b) the built-in model's decode step of one sequence with the kernel on and off, interleaved
    round by round (bench_expert_pairs_cpu's interleaved_decode_steps): median thread-CPU time per step.
Both check the kernel's result against torch's (the same greedy tokens in (b)).
"""

from __future__ import annotations


import pytest
import torch

from bench_expert_pairs_cpu import interleaved_decode_steps, modules_with
from r3srv import LLM, settings
from r3srv.ops import ops_for

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def rms_norm_op(on: bool):
    """The CPU backend's RMSNorm with the kernel on or off."""
    with settings.overridden(rust_rms_norm=on):
        return ops_for("cpu", torch.float32).norm("default")


@pytest.mark.parametrize("candidate", ["reference", "r3srv"])
@pytest.mark.parametrize("shape", [(1, 256), (1, 4, 64), (16, 256)], ids=lambda s: "x".join(map(str, s)))
def test_rms_norm(benchmark, shape, candidate):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(*shape, generator=g), torch.rand(shape[-1], generator=g) + 0.5
    benchmark.group = f"rms_norm {'x'.join(map(str, shape))}"
    out = benchmark(rms_norm_op(candidate == "r3srv"), x, w, 1e-6)
    torch.testing.assert_close(out, torch.rms_norm(x, (shape[-1],), w, 1e-6), rtol=2e-6, atol=2e-6)


def test_decode_step(benchmark):
    llm = LLM(max_model_len=512, enable_prefix_caching=False, max_num_seqs=8)
    med = interleaved_decode_steps(benchmark, llm, 1, modules_with(llm, rust_rms_norm=None))
    print(f"\ndecode step, 1 sequence, median thread CPU per step: torch rms_norm {med[False][0] * 1e3:.2f} ms, "
          f"Rust {med[True][0] * 1e3:.2f} ms, {med[False][0] / med[True][0]:.2f}x")
