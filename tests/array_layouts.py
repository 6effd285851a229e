"""Memory layouts of one array for the encoders' tests: every view shares the base's memory."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

LAYOUTS = ["C", "F", "transposed", "strided", "broadcast"]


def layout_view(base: np.ndarray, layout: str, data: st.DataObject) -> np.ndarray:
    """A view of `base` in the requested memory layout (all views share base's memory)."""
    if layout == "C":
        return base
    if layout == "F":
        return np.asfortranarray(base)
    if layout == "transposed":
        return base.T
    if layout == "strided":
        # A step or a reversal on some axis, then maybe a transpose of the result.
        ax = data.draw(st.integers(0, base.ndim - 1), label="axis")
        step = data.draw(st.sampled_from([2, -1, -2, 3]), label="step")
        idx = [slice(None)] * base.ndim
        idx[ax] = slice(None, None, step)
        view = base[tuple(idx)]
        return view.T if data.draw(st.booleans(), label="transpose") else view
    if layout == "broadcast":
        # A zero stride on a new leading axis.
        return np.broadcast_to(base, (data.draw(st.integers(0, 3)),) + base.shape)
    raise AssertionError(layout)
