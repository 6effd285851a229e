"""The paged decode attention kernel in Triton's interpreter (the cases:
tests/paged_decode_cases.py), in a fresh subprocess (tests/interpreter_testing.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from interpreter_testing import assert_cases_pass_in_interpreter

pytestmark = pytest.mark.slow  # Triton's interpreter in subprocesses


def test_paged_decode_kernel_matches_the_torch_path_in_the_triton_interpreter():
    pytest.importorskip("triton", reason="triton is not installed (it ships with torch on Linux)")
    assert_cases_pass_in_interpreter(Path(__file__).with_name("paged_decode_cases.py"),
                                     R3SRV_FAST_CPU_DECODE="0")  # its cases swap the modules' decode kernel


def test_contexts_split_only_when_the_batch_leaves_the_gpu_idle():
    pytest.importorskip("triton", reason="triton is not installed (it ships with torch on Linux)")
    from r3srv.kernels.paged_decode_triton import MAX_SPLITS, PROGRAMS_PER_PROCESSOR, SPLIT_MIN_KEYS, choose_splits

    enough = PROGRAMS_PER_PROCESSOR * 132
    assert choose_splits(enough, 1 << 20, 132) == 1  # the batch fills the GPU by itself
    assert choose_splits(8, SPLIT_MIN_KEYS - 1, 132) == 1  # too short to split
    assert choose_splits(8, 3 * SPLIT_MIN_KEYS, 132) == 3  # parts no shorter than SPLIT_MIN_KEYS
    assert choose_splits(enough // 4, 1 << 20, 132) == 4  # just enough programs
    assert choose_splits(1, 1 << 20, 132) == MAX_SPLITS
