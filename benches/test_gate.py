"""Benchmark regression gate (run by `make bench-gate` in .ci/run).

Fails when the Rust encoder is less than 3x faster than the reference at 1 row or at 8,192
rows. The measure is a same-run ratio of medians with the two candidates interleaved round
by round, never an absolute time; a noisy attempt is retried, and the best of three counts
(noise only ever slows one side by chance, a real regression fails every attempt).
"""

from __future__ import annotations

import numpy as np
import pytest

from r3srv.serial import encode_routed_experts, numpy2base64
from serial_cases import interleaved_medians, make_array

MIN_SPEEDUP = 3.0
ATTEMPTS = 3


@pytest.mark.parametrize("rows", [1, 8192])
def test_encoder_beats_reference(rows):
    array = make_array((rows, 48, 8), np.uint8)
    assert encode_routed_experts(array) == numpy2base64(array)
    ratios = []
    for _ in range(ATTEMPTS):
        med = interleaved_medians(
            {"reference": lambda: numpy2base64(array), "rust": lambda: encode_routed_experts(array, 0)},
            rounds=21,
        )
        ratios.append(med["reference"] / med["rust"])
        if ratios[-1] >= MIN_SPEEDUP:
            break
    print(f"rows={rows}: reference/rust speed-up per attempt {[round(r, 1) for r in ratios]}")
    assert max(ratios) >= MIN_SPEEDUP, f"encoder only {max(ratios):.2f}x faster than the reference at {rows} rows"
