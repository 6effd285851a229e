"""The fused Triton router kernel in Triton's interpreter (the cases: tests/router_triton_cases.py).

Triton reads TRITON_INTERPRET when it is first imported, and in a pytest run anything may
have imported it already; so the cases run in a fresh subprocess started with the variable
set, and the result never depends on test order.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

CASES = Path(__file__).with_name("router_triton_cases.py")
SEED = int.from_bytes(os.urandom(4), "little")  # passed down: fresh logits, replayable


def test_kernel_matches_reference_in_the_triton_interpreter():
    pytest.importorskip("triton", reason="triton is not installed (it ships with torch on Linux)")
    env = dict(os.environ, TRITON_INTERPRET="1", R3SRV_ROUTER_TEST_SEED=str(SEED))
    env.pop("R3SRV_FORCE_TORCH_ROUTER", None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(CASES)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=CASES.parent.parent)
    lines = done.stdout.strip().splitlines()
    summary = lines[-1] if lines else ""
    assert done.returncode == 0 and " passed" in summary and "skipped" not in summary, (
        f"interpreter cases failed (R3SRV_ROUTER_TEST_SEED={SEED}):\n{done.stdout[-8000:]}\n{done.stderr[-2000:]}"
    )
