"""The fused decode steps of the recurrent layers in Triton's interpreter (the cases: tests/recurrent_triton_cases.py),
in a fresh subprocess started with TRITON_INTERPRET=1 (see tests/test_router_triton.py for why)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

CASES = Path(__file__).with_name("recurrent_triton_cases.py")


def test_fused_steps_match_the_torch_steps_in_the_triton_interpreter():
    pytest.importorskip("triton", reason="triton is not installed (it ships with torch on Linux)")
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(CASES)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=CASES.parent.parent)
    lines = done.stdout.strip().splitlines()
    summary = lines[-1] if lines else ""
    assert done.returncode == 0 and " passed" in summary and "skipped" not in summary, (
        f"interpreter cases failed:\n{done.stdout[-8000:]}\n{done.stderr[-2000:]}"
    )
