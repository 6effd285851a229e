"""The CPU backend's fused decode step (r3srv.ops.cpu_decode) against the modules, in float32 and
bfloat16, as same-run ratios.

    .venv/bin/python -m pytest benches/bench_fast_decode_cpu.py -s

The built-in model's decode step of 1 and 16 sequences with the fast path on and off on one
engine (its model's ops selected again for each), interleaved round by round
(bench_expert_pairs_cpu's interleaved_decode_steps): median thread-CPU and wall time per step,
the same greedy tokens asserted. The two take the same kernels; the fused step skips the modules' dispatch and the wrappers' repeated checks.
"""

from __future__ import annotations

import pytest

from bench_expert_pairs_cpu import decode_step_report, interleaved_decode_steps
from engine_testing import model_of, rebound
from r3srv import LLM

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("num_seqs", [1, 16])
def test_decode_step(benchmark, num_seqs, dtype):
    llm = LLM(dtype=dtype, max_model_len=512, enable_prefix_caching=False, max_num_seqs=16)
    med = interleaved_decode_steps(benchmark, llm, num_seqs, lambda on: rebound(model_of(llm), fast_cpu_decode=on))
    print(f"\n{dtype}" + decode_step_report(med, num_seqs, off="modules", on="fused step"))
