"""The model's weights in transparent huge pages (r3srv/huge_pages.py, the default) against the
same model's weights in 4 KiB pages, as same-run ratios.

    .venv/bin/python -m pytest benches/bench_huge_pages.py -s

Two engines on the built-in model live in one process, one built with settings.huge_pages off,
the other with it on; their decode steps of 1 and 16 sequences are interleaved round by round,
alternating which goes first (bench_expert_pairs_cpu's decode_steps), in float32 and bfloat16.
Printed: the processor and its instruction sets, how much of the process the kernel gave huge
pages as each engine was built (AnonHugePages), and the median thread-CPU and wall time per
step of each with their ratio (> 1: huge pages are faster); both engines' greedy tokens are
asserted equal.
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path

import pytest
import torch

from bench_expert_pairs_cpu import decode_step_report, decode_steps
from bench_vs_vllm import processor_line
from r3srv import LLM, settings

ROUNDS = int(os.environ.get("R3SRV_BENCH_ROUNDS", "5"))

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def huge_bytes() -> int:
    """AnonHugePages of this process, in bytes."""
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    return 0


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def engines(request):
    """{False: the engine built with huge pages off, True: on}, and each one's AnonHugePages growth."""
    built, grew = {}, {}
    for on in (False, True):
        before = huge_bytes()
        with settings.overridden(huge_pages=on):
            built[on] = LLM(dtype=request.param, max_model_len=512, enable_prefix_caching=False, max_num_seqs=16)
        grew[on] = huge_bytes() - before
    yield request.param, built, grew
    for llm in built.values():
        llm.engine.shutdown()


@pytest.mark.parametrize("num_seqs", [1, 16])
def test_decode_step(benchmark, engines, num_seqs):
    dtype, built, grew = engines
    per: dict[bool, tuple[list[float], list[float]]] = {False: ([], []), True: ([], [])}
    for on in (False, True):
        decode_steps(built[on], num_seqs, 4, 9999)  # warm-up

    def one_round(round_no=iter(range(10_000))) -> None:
        r = next(round_no)
        generated = {}
        for on in (False, True) if r % 2 == 0 else (True, False):
            cpu, wall, generated[on] = decode_steps(built[on], num_seqs, 32, r)
            per[on][0].extend(cpu)
            per[on][1].extend(wall)
        assert generated[True] == generated[False]

    benchmark.pedantic(one_round, rounds=ROUNDS, iterations=1)
    med = {on: (statistics.median(c), statistics.median(w)) for on, (c, w) in per.items()}
    benchmark.extra_info.update(cpu_ratio=med[False][0] / med[True][0], wall_ratio=med[False][1] / med[True][1])
    print(f"\n{processor_line()}\n{dtype}: huge pages gained as each engine was built: off {grew[False] >> 20} MiB, "
          f"on {grew[True] >> 20} MiB; kernel threads {settings.current().cpu_threads}, torch threads "
          f"{torch.get_num_threads()}" + decode_step_report(med, num_seqs, off="4 KiB pages", on="huge pages"))
