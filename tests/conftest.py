"""Shared by every test: fixed seeds, deterministic Hypothesis, and a way to run a test under
other settings."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from r3srv import settings

try:
    import hypothesis
except ImportError:  # the GPU machine's image (benches/gpu_check.sh) runs only tests without it
    hypothesis = None
if hypothesis is not None:
    # Every run draws the same examples (derandomize: from each test's own source), and nothing
    # found by an earlier run on this machine is replayed first: a failure reproduces anywhere.
    hypothesis.settings.register_profile("r3srv", derandomize=True, database=None, print_blob=True)
    hypothesis.settings.load_profile("r3srv")


@pytest.fixture(autouse=True)
def fixed_seeds():
    """Every test starts from the same global random state, whatever ran before it (tests
    should still pass their own generators: this catches the ones that do not)."""
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


@pytest.fixture
def r3srv_settings():
    """`r3srv_settings(grouped_mm=False, ...)` makes those this process's settings (see
    r3srv/settings.py) until the test ends; returns the new settings."""
    previous = settings.current()

    def change(**fields) -> settings.Settings:
        changed = settings.current().replace(**fields)
        settings.configure(changed)
        return changed

    yield change
    settings.configure(previous)
