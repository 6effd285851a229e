"""The plain-Python launch arithmetic equals Triton's constexpr functions it stands in for."""

import pytest

triton = pytest.importorskip("triton")

from r3srv.kernels.launch import cdiv, next_power_of_2  # noqa: E402


def test_next_power_of_2_equals_tritons():
    assert [next_power_of_2(n) for n in range(1, 70_000)] == [triton.next_power_of_2(n) for n in range(1, 70_000)]


def test_cdiv_equals_tritons():
    pairs = [(a, b) for a in range(0, 600) for b in (1, 2, 3, 7, 16, 32, 64, 100, 128)]
    assert [cdiv(a, b) for a, b in pairs] == [triton.cdiv(a, b) for a, b in pairs]
