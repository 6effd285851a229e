"""r3srv.transfer.to_device: host arrays as device tensors of one dtype, in one transfer that
on CUDA does not wait for the GPU (the CUDA case skips on the CPU, with the reason)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from r3srv.transfer import to_device


def _arrays():
    return [np.arange(5), np.full((3, 4), -1, dtype=np.int32), np.array([True, False]), np.zeros(0, dtype=np.int64)]


def test_values_shapes_and_int64_on_the_cpu():
    arrays = _arrays()
    moved = to_device(arrays, torch.device("cpu"))
    assert [t.shape for t in moved] == [a.shape for a in arrays]
    assert all(t.dtype == torch.int64 for t in moved)
    for t, a in zip(moved, arrays):
        np.testing.assert_array_equal(t.numpy(), a.astype(np.int64))
    (temperatures,) = to_device([[0.7, 1.0]], torch.device("cpu"), np.float32)
    assert temperatures.dtype == torch.float32 and temperatures.tolist() == pytest.approx([0.7, 1.0])


@pytest.mark.gpu("pinned, non-blocking copies")
def test_a_cuda_transfer_waits_for_nothing_and_owns_its_data():
    arrays = _arrays()
    torch.cuda._sleep(50_000_000)  # the GPU is busy: a blocking copy would wait for it
    torch.cuda.set_sync_debug_mode("error")
    try:
        moved = to_device(arrays, torch.device("cuda"))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    arrays[0][:] = 99  # the host arrays may change at once: the copy took its own pinned block
    for t, a in zip(moved, _arrays()):
        assert t.is_cuda and t.dtype == torch.int64 and t.shape == a.shape
        np.testing.assert_array_equal(t.cpu().numpy(), a.astype(np.int64))
