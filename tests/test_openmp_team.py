"""r3srv.kernels.openmp_team: one OpenMP team per process, the core thread's. Each check runs in
a fresh interpreter (a team, a spin count and a thread's torch count outlive a test)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest
import torch

from r3srv.kernels.kernel_threads import torch_openmp_library

needs_libgomp = pytest.mark.skipif(torch_openmp_library() is None,
                                   reason="torch runs no GNU OpenMP here: no team to end")
needs_two_cpus = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2,
                                    reason="a team of two needs two CPUs (libgomp throttles a larger one)")

ENDING = """
import os, threading, time, torch
from r3srv.kernels.openmp_team import end_team_here, serial_torch_here

def threads():
    return len(os.listdir("/proc/self/task"))

def settle(expected):
    for _ in range(200):  # a team's threads leave after the call returns
        if threads() == expected:
            return
        time.sleep(0.05)
    raise AssertionError(f"{threads()} threads, {expected} expected")

torch.set_num_threads(2)
alone = threads()
torch.ones(1 << 22).mul(2).sum()  # a parallel op: this thread's team starts
assert threads() == alone + 1, (alone, threads())
assert end_team_here()
settle(alone)
torch.ones(1 << 22).mul(2).sum()  # a later op starts another
assert threads() == alone + 1
serial_torch_here()
settle(alone)
assert torch.get_num_threads() == 1
torch.ones(1 << 22).mul(2).sum()
assert threads() == alone, "an op after serial_torch_here started a team"
other = []
thread = threading.Thread(target=lambda: other.append(torch.get_num_threads()))
thread.start(); thread.join()
assert other == [2], f"another thread's count changed: {other}"
print("ok")
"""

# libgomp's threads spin for GOMP_SPINCOUNT turns (here: minutes) after each parallel region,
# unless the process's teams hold more threads than there are CPUs: then for 100 turns.
SPINNING = """
import asyncio, os, time
from r3srv.engine.async_llm import AsyncLLM
from r3srv.sampling_params import SamplingParams

def busy():
    ticks = {}
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        ticks[tid] = int(fields[11]) + int(fields[12])  # utime + stime
    return ticks

def spinning(seconds=1.0):
    before = busy(); time.sleep(seconds); after = busy()
    per_second = os.sysconf("SC_CLK_TCK")
    return sorted((after[t] - before.get(t, 0)) / per_second / seconds for t in after)[-1]

engine = AsyncLLM(dtype="float32", max_model_len=2048)
built = spinning()
assert built < 0.2, f"a thread of the team that built the engine spins on ({built:.0%} of a CPU)"

async def one():
    params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0)
    async for out in engine.generate([i % 250 + 1 for i in range(1000)], params, "r"):
        pass
    return out

assert len(asyncio.run(one()).outputs[0].token_ids) == 4
stepped = spinning()
# throttled, it spins 100 turns (microseconds); spinning, it keeps a CPU or its share of one
assert stepped > 0.1, f"the core thread's team sleeps between regions ({stepped:.0%} of a CPU): throttled"
engine.shutdown()
print("ok")
"""


def run(script: str, **env: str) -> None:
    full = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    done = subprocess.run([sys.executable, "-c", script], env={**full, **env}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr


@needs_libgomp
@needs_two_cpus
def test_a_thread_ends_its_team_and_runs_serially_after():
    run(ENDING, GOMP_SPINCOUNT="0")


@needs_libgomp
@needs_two_cpus
def test_the_engine_leaves_the_core_thread_the_only_team():
    run(SPINNING, GOMP_SPINCOUNT="100000000000", R3SRV_CPU_THREADS="2")


@needs_libgomp
def test_the_servers_threads_run_torch_serially():
    from litestar.testing import TestClient

    from r3srv.server.app import create_app

    class Engine:
        is_running = True

        class core:
            lora = None

        @staticmethod
        def stats():
            return None

        def shutdown(self):
            pass

    with TestClient(create_app(Engine(), served_model_name="m")) as client:
        async def counts():
            return torch.get_num_threads(), await asyncio.to_thread(torch.get_num_threads)

        assert client.blocking_portal.call(counts) == (1, 1)
