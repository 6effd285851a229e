"""The fused decode steps of the recurrent layers in Triton's interpreter (the cases:
tests/recurrent_triton_cases.py), in a fresh subprocess (tests/interpreter_testing.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from interpreter_testing import assert_cases_pass_in_interpreter

pytestmark = pytest.mark.slow  # Triton's interpreter in subprocesses


def test_fused_steps_match_the_torch_steps_in_the_triton_interpreter():
    pytest.importorskip("triton", reason="triton is not installed (it ships with torch on Linux)")
    assert_cases_pass_in_interpreter(Path(__file__).with_name("recurrent_triton_cases.py"))
