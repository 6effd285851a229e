"""Shared by the engine tests: greedy settings, deterministic prompts, one torch thread."""

import time

import pytest
import torch

GREEDY = dict(temperature=0.0, ignore_eos=True)


def prompt_ids(n: int, base: int = 0) -> list[int]:
    """Distinct printable-byte prompts (the built-in tokenizer maps bytes to ids 0..255)."""
    return [32 + (base * 7 + i * 13) % 90 for i in range(n)]


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Import into a test module to run its torch ops outside the model on one thread: tiny
    ops gain nothing from a second intra-op thread, and on a shared 2-core machine a busy
    core makes OpenMP's spin-waits 10-50x slower. (The forward itself uses
    $R3SRV_CPU_THREADS, default 1, whatever this says.)"""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def slowed(engine):
    """5 ms more per step of an AsyncLLM: a request stays running while an update and other
    requests arrive, however fast the machine."""
    step = engine._engine.step

    def slow_step():
        time.sleep(0.005)
        return step()

    engine._engine.step = slow_step
    return engine
