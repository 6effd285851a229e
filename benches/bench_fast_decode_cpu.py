"""The CPU decode fast path (r3srv.models.cpu_decode) against the modules, in float32 and
bfloat16, as same-run ratios.

    .venv/bin/python -m pytest benches/bench_fast_decode_cpu.py -s

The built-in model's decode step of 1 and 16 sequences with the fast path on and off on one
engine, interleaved round by round (bench_expert_pairs_cpu's interleaved_decode_steps): median
thread-CPU and wall time per step, the same greedy tokens asserted. The two take the same
kernels; the fast path skips the modules' dispatch and the wrappers' repeated checks.
"""

from __future__ import annotations

import pytest

from bench_expert_pairs_cpu import decode_step_report, interleaved_decode_steps
from r3srv import LLM, settings

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def fast_path(on: bool):
    return settings.overridden(fast_cpu_decode=on)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("num_seqs", [1, 16])
def test_decode_step(benchmark, num_seqs, dtype):
    llm = LLM(dtype=dtype, max_model_len=512, enable_prefix_caching=False, max_num_seqs=16)
    med = interleaved_decode_steps(benchmark, llm, num_seqs, fast_path)
    print(f"\n{dtype}" + decode_step_report(med, num_seqs, off="modules", on="fast path"))
