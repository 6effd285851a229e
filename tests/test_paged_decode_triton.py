"""The paged decode attention kernel in Triton's interpreter (the cases:
tests/paged_decode_cases.py), in a fresh subprocess (tests/interpreter_testing.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from interpreter_testing import assert_cases_pass_in_interpreter


def test_paged_decode_kernel_matches_the_torch_path_in_the_triton_interpreter():
    pytest.importorskip("triton", reason="triton is not installed (it ships with torch on Linux)")
    assert_cases_pass_in_interpreter(Path(__file__).with_name("paged_decode_cases.py"))
