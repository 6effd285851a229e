"""The fused Triton router kernel in Triton's interpreter (the cases: tests/router_triton_cases.py),
in a fresh subprocess (tests/interpreter_testing.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from interpreter_testing import assert_cases_pass_in_interpreter

pytestmark = pytest.mark.slow  # Triton's interpreter in subprocesses

CASES = Path(__file__).with_name("router_triton_cases.py")
SEED = 20261201  # passed down: the same logits every run


def test_kernel_matches_reference_in_the_triton_interpreter():
    pytest.importorskip("triton", reason="triton is not installed (it ships with torch on Linux)")
    assert_cases_pass_in_interpreter(CASES, R3SRV_ROUTER_TEST_SEED=str(SEED))
