"""benches/gpu_router.py must run when a GPU session finally gets one: check the script
itself on the CPU (no-CUDA exit, and a --smoke run of every part at toy sizes)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # kernel compiles and timings

SCRIPT = Path(__file__).resolve().parent.parent / "benches" / "gpu_router.py"


def run(*args: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "R3SRV_FORCE_TORCH_ROUTER")}
    return subprocess.run([sys.executable, str(SCRIPT), *args], env=full_env | env, capture_output=True,
                          text=True, timeout=600, cwd=SCRIPT.parent.parent)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the script would really run")
def test_without_cuda_it_says_so_and_exits_cleanly():
    done = run()
    assert done.returncode == 0, done.stderr
    assert "no CUDA device" in done.stdout and "Traceback" not in done.stderr
    assert run("--require-gpu").returncode == 1


@pytest.mark.slow
def test_smoke_run_exercises_every_part_on_the_cpu():
    done = run("--smoke", TRITON_INTERPRET="1")
    out = done.stdout
    assert done.returncode == 0, out[-3000:] + done.stderr[-3000:]
    assert "correctness: PASS" in out and "0 failures" in out
    assert "| router T=64 E=128 k=8 |" in out
    assert "decode step B=2, capture on vs off" in out, out[-3000:] + done.stderr[-3000:]  # the engine part ran
    assert "capture work per decode step B=2" in out and "paged decode kernel vs gather + SDPA" in out
    assert "Traceback" not in done.stderr


@pytest.mark.slow
def test_decode_attention_script_smoke_runs_on_the_cpu():
    """benches/gpu_decode_attention.py --smoke: every row (splits checked equal, timed) at toy sizes."""
    script = SCRIPT.with_name("gpu_decode_attention.py")
    env = {k: v for k, v in os.environ.items() if k != "R3SRV_TRITON_DECODE"} | {"TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, str(script), "--smoke"], env=env, capture_output=True, text=True,
                          timeout=600, cwd=SCRIPT.parent.parent)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and "tokens" in line]
    assert len(rows) == 3 and not any("failed" in row for row in rows), done.stdout
