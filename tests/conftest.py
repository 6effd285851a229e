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


# Test tiers are markers in the test files (pyproject.toml lists them): `slow` (real servers,
# worker processes, transformers oracles, Triton's interpreter, kernel compiles: `make test-fast`
# leaves them out), `gpu` (needs CUDA; skipped here on a machine without it), `peer` (checks
# r3srv against a peer's own code or data recorded from it: `make test-peer`).

def pytest_collection_modifyitems(config, items):
    """Files holding a slow-marked test first, in their collected order (under pytest-xdist's
    --dist loadfile a file is a unit of work, handed out in this order: the long ones start first
    instead of being left to the end). A test marked gpu, or gpu("what it needs the GPU for"), skips
    where torch sees no CUDA device."""
    slow_files = {item.nodeid.split("::")[0] for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in slow_files)  # stable: order kept within
    if torch.cuda.is_available():
        return
    for item in items:
        marker = item.get_closest_marker("gpu")
        if marker is not None:
            detail = f" ({marker.args[0]})" if marker.args else ""
            item.add_marker(pytest.mark.skip(reason=f"needs a CUDA GPU{detail}"))


@pytest.fixture(autouse=True)
def fixed_seeds():
    """Every test starts from the same global random state, whatever ran before it (tests
    should still pass their own generators: this catches the ones that do not)."""
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def gate(tmp_path_factory):
    """A StepGate (tests/step_gate.py), open, for the module's engine or server to step behind:
    gate_steps(engine.core, gate.path) or RemoteServer(..., step_gate=gate)."""
    from step_gate import StepGate

    return StepGate(tmp_path_factory.mktemp("gate") / "steps")


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
