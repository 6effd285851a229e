"""pytest-benchmark: the Rust encoder, the reference and the bare pybase64 anchor, per size.

    make bench        # every size; benches/conftest.py prints same-run ratios at the end

Each size is one benchmark group; the ratios of its medians are the numbers that matter
(absolute times swing with the load of a shared machine).
"""

from __future__ import annotations

import numpy as np
import pytest

from serial_cases import CASES, candidates, make_array

_ARRAYS: dict[str, np.ndarray] = {}


def _array(label, shape, dtype) -> np.ndarray:
    if label not in _ARRAYS:
        _ARRAYS.clear()  # keep one large array alive at a time
        _ARRAYS[label] = make_array(shape, dtype)
    return _ARRAYS[label]


@pytest.mark.parametrize("candidate", ["reference", "rust", "pybase64 bare"])
@pytest.mark.parametrize("label, shape, dtype", CASES, ids=[c[0].replace(" ", "-") for c in CASES])
def test_encode(benchmark, label, shape, dtype, candidate):
    array = _array(label, shape, dtype)
    fn = candidates(array)[candidate]
    benchmark.group = label
    benchmark.extra_info["nbytes"] = array.nbytes
    result = benchmark(fn)
    if candidate == "rust":
        assert result == candidates(array)["reference"]()
