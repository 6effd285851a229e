"""Run a cases file of Triton kernels in Triton's interpreter: in a fresh subprocess started with
TRITON_INTERPRET=1, since triton reads the variable when first imported and in a pytest run
anything may have imported it already (so a result never depends on test order)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def assert_cases_pass_in_interpreter(cases: Path, **env: str) -> None:
    """Every case of `cases` passes (none skipped) under TRITON_INTERPRET=1; `env` is added."""
    environment = dict(os.environ, TRITON_INTERPRET="1", **env)
    environment.pop("R3SRV_FORCE_TORCH_ROUTER", None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(cases)]
    done = subprocess.run(cmd, env=environment, capture_output=True, text=True, timeout=900, cwd=cases.parent.parent)
    lines = done.stdout.strip().splitlines()
    summary = lines[-1] if lines else ""
    assert done.returncode == 0 and " passed" in summary and "skipped" not in summary, (
        f"interpreter cases of {cases.name} failed ({env}):\n{done.stdout[-8000:]}\n{done.stderr[-2000:]}"
    )


def every_pair(first: list, second: list, third: list) -> list[tuple]:
    """A pairwise design of three axes: every value of each axis meets every value of each other
    axis, in len(first) * len(second) cases instead of the product of all three (the interpreter
    runs a launch in Python, so cases are what cost). The third axis takes its value
    (i + j) % len(third) at case (i, j); that meets every pair when neither of the first two axes
    is shorter than the third."""
    assert len(third) <= min(len(first), len(second)), "the third axis must be the shortest"
    return [(a, b, third[(i + j) % len(third)]) for i, a in enumerate(first) for j, b in enumerate(second)]


def skip_unless_interpreted(runner: str) -> None:
    """At the top of a cases file: skip the whole module unless this process started with
    TRITON_INTERPRET=1 (`runner`, the test file that starts one, says where it runs)."""
    import pytest

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip(f"needs a process started with TRITON_INTERPRET=1 (see {runner})", allow_module_level=True)
