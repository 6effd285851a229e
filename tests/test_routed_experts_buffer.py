"""The host buffer of routed-experts rows: steps scatter by KV slot, later steps overwrite reused
slots, gathers follow block tables. From CUDA captures the copy is queued and lands at the next
read or store (the CUDA cases skip on the CPU, with the reason)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from r3srv.engine.routed_experts import RoutedExpertsBuffer

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (queued copies into pinned memory)")])]


def _capture(buffer, ids: list[list[int]], device) -> torch.Tensor:
    capture = buffer.new_capture(len(ids), device)
    capture[:, 1] = torch.tensor(ids, dtype=capture.dtype, device=device)  # layer 0 is dense: stays 0
    return capture


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_experts", [64, 300])
def test_steps_scatter_by_slot_and_the_latest_step_wins(device, num_experts):
    buffer = RoutedExpertsBuffer(num_slots=32, num_layers=2, top_k=2, num_experts=num_experts)
    first = [[i, 299 - i if num_experts > 256 else 63 - i] for i in range(6)]
    buffer.store(np.array([4, 5, 6, 7, 8, 9]), _capture(buffer, first, device))
    second = [[50 + i, 51 + i] for i in range(3)]
    buffer.store(np.array([8, 9, 10]), _capture(buffer, second, device))  # slots 8, 9 reused
    # a sequence whose block table is [2, 1] (block size 4): tokens 0-3 in slots 8-11, 4-7 in 4-7
    rows = buffer.gather([2, 1], 4, num_rows=7, start=1)
    assert rows.dtype == (np.uint8 if num_experts <= 256 else np.uint16)
    want = np.array([second[1], second[2], [0, 0], first[0], first[1], first[2]])
    np.testing.assert_array_equal(rows[:, 1], want)
    assert not rows[:, 0].any()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (queued copies into pinned memory)")
def test_a_cuda_store_waits_for_nothing_until_read():
    """The store returns with the copy queued behind the step's work; a read sees it landed,
    also after the capture's memory went back to the allocator; larger steps grow the staging."""
    buffer = RoutedExpertsBuffer(num_slots=4096, num_layers=2, top_k=2, num_experts=64)
    torch.cuda._sleep(50_000_000)  # the GPU is busy for a while: the copy cannot have run yet
    ids = [[i % 64, (i + 1) % 64] for i in range(1000)]
    buffer.store(np.arange(1000), _capture(buffer, ids, "cuda"))
    assert buffer._pending is not None  # queued, not waited for
    torch.zeros(1 << 20, device="cuda")  # the capture's memory may be reused meanwhile
    np.testing.assert_array_equal(buffer.gather([0], 4096, num_rows=1000)[:, 1], ids)
    assert buffer._pending is None
