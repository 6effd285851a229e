"""The host buffer of routed-experts rows: steps scatter by KV slot, later steps overwrite reused
slots, gathers follow block tables. From CUDA captures the copy is queued and lands at the next
read or store (the CUDA cases skip on the CPU, with the reason)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from r3srv.engine.routed_experts import RoutedExpertsBuffer

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu("queued copies into pinned memory"))]


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


@pytest.mark.gpu("queued copies into pinned memory")
def test_a_cuda_store_waits_for_nothing_until_read():
    """The store returns with the copy queued behind the step's work; a read sees it landed,
    also after the next step's routers (queued behind the copy) overwrote the capture."""
    buffer = RoutedExpertsBuffer(num_slots=4096, num_layers=2, top_k=2, num_experts=64)
    torch.cuda._sleep(50_000_000)  # the GPU is busy for a while: the copy cannot have run yet
    ids = [[i % 64, (i + 1) % 64] for i in range(1000)]
    buffer.store(np.arange(1000), _capture(buffer, ids, "cuda"))
    assert buffer._pending is not None  # queued, not waited for
    buffer.new_capture(1000, "cuda").fill_(7)  # the next step's routers write the same memory
    np.testing.assert_array_equal(buffer.gather([0], 4096, num_rows=1000)[:, 1], ids)
    assert buffer._pending is None


@pytest.mark.parametrize("device", DEVICES)
def test_steps_reuse_one_capture_whose_dense_layers_stay_zero(device):
    """Each step's capture is the leading rows of one buffer (zeroed once, grown for a larger
    step): a step's MoE column holds only its own ids, the dense layer's column stays zero."""
    buffer = RoutedExpertsBuffer(num_slots=1024, num_layers=2, top_k=2, num_experts=64)
    first = buffer.new_capture(300, device)  # more than the first allocation: grows
    assert first.shape == (300, 2, 2) and not first.any()
    for step, tokens in enumerate([300, 5, 600]):
        ids = [[(step + i) % 64, (step + 2 * i) % 64] for i in range(tokens)]
        capture = _capture(buffer, ids, device)
        assert capture.shape[0] == tokens
        buffer.store(np.arange(tokens) + 400 * (step % 2), capture)
        rows = buffer.gather([0], 1024, num_rows=400 * (step % 2) + tokens, start=400 * (step % 2))
        np.testing.assert_array_equal(rows[:, 1], ids)
        assert not rows[:, 0].any()
