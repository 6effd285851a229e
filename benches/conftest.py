"""Benchmark helpers: put benches/ (and tests/, for engine_testing's helpers) on the path and
print same-run ratios of medians."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.append(str(Path(__file__).parents[1] / "tests"))


@pytest.fixture(autouse=True)
def fixed_seeds():
    """Every benchmark draws the same inputs on every run."""
    import random

    import numpy as np
    import torch

    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


@pytest.fixture
def one_torch_thread():
    """Time a kernel on one torch thread: a shared 2-core machine makes a second one noise."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def pytest_terminal_summary(terminalreporter):
    session = getattr(terminalreporter.config, "_benchmarksession", None)
    benchmarks = getattr(session, "benchmarks", None) or []
    medians: dict[str, dict[str, float]] = {}
    for bench in benchmarks:
        candidate = bench.name.rsplit("[", 1)[-1].rstrip("]").split("-")[-1]  # the last id part
        stats = getattr(bench, "stats", None)
        if stats is not None and bench.group:
            medians.setdefault(bench.group, {})[candidate] = stats.median
    if not medians:
        return
    from serial_cases import machine_description

    write = terminalreporter.write_line
    write("")
    serial = {g: m for g, m in medians.items() if {"reference", "rust", "pybase64 bare"} <= m.keys()}
    if serial:
        write("same-run ratios of medians (reference / rust, rust / pybase64 bare):")
        for group, m in serial.items():
            write(f"  {group:16s} {m['reference'] / m['rust']:6.1f}x   {m['rust'] / m['pybase64 bare']:5.2f}")
    other = {g: m for g, m in medians.items() if {"reference", "r3srv"} <= m.keys()}
    if other:
        write("same-run ratios of medians (reference / r3srv):")
        for group, m in other.items():
            write(f"  {group:24s} {m['reference'] / m['r3srv']:6.1f}x")
    for key, value in machine_description().items():
        write(f"  {key}: {value}")
