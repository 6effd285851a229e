"""Shared benchmark cases and a same-run timer for the routed-experts encoder.

Every number we report is a ratio of medians measured in the same run, with the candidates
interleaved round by round, so that a noisy shared machine slows them alike.
"""

from __future__ import annotations

import gc
import os
import platform
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np
import pybase64

from r3srv.serial import encode_routed_experts, encoder_isa, numpy2base64

# (label, shape, dtype): one row (~0.5 KB) to 131,072 rows (~64 MB), the range the encoder's targets span.
CASES = [
    ("1x48x8 u8", (1, 48, 8), np.uint8),
    ("512x48x8 u8", (512, 48, 8), np.uint8),
    ("8192x48x8 u8", (8192, 48, 8), np.uint8),
    ("32768x48x8 u8", (32768, 48, 8), np.uint8),
    ("131072x61x8 u8", (131072, 61, 8), np.uint8),
    ("8192x48x8 u16", (8192, 48, 8), np.uint16),
]


def make_array(shape, dtype) -> np.ndarray:
    high = 256 if np.dtype(dtype).itemsize == 1 else 1024
    return np.random.default_rng(0).integers(0, high, shape).astype(dtype)


def candidates(array: np.ndarray) -> dict[str, Callable[[], object]]:
    """The reference, the Rust encoder, and the anchor: pybase64 of the bare buffer."""
    return {
        "reference": lambda: numpy2base64(array),
        "rust": lambda: encode_routed_experts(array, 0),
        "pybase64 bare": lambda: pybase64.b64encode(array.data),
    }


def _time_batch(fn: Callable[[], object], number: int) -> float:
    t0 = time.perf_counter()
    for _ in range(number):
        fn()
    return (time.perf_counter() - t0) / number


def interleaved_medians(fns: dict[str, Callable[[], object]], rounds: int, budget_s: float = 0.02) -> dict[str, float]:
    """Median seconds per call of each fn, measured in interleaved rounds."""
    for fn in fns.values():  # warm up (and fault in the allocator's arenas)
        fn()
    slowest = max(_time_batch(fn, 1) for fn in fns.values())
    number = max(1, int(budget_s / max(slowest, 1e-9) / len(fns)))
    samples: dict[str, list[float]] = {name: [] for name in fns}
    gc_was = gc.isenabled()
    gc.disable()
    try:
        # A fresh random order every round: each candidate follows each other one equally
        # often, so none always inherits the heap (and page faults) another one left behind.
        shuffler = random.Random(0)
        for _ in range(rounds):
            order = list(fns.items())
            shuffler.shuffle(order)
            for name, fn in order:
                samples[name].append(_time_batch(fn, number))
    finally:
        if gc_was:
            gc.enable()
    return {name: float(np.median(s)) for name, s in samples.items()}


def print_table_in_processes(script: str, header: str, labels: list[str], rounds: int) -> None:
    """The machine, then `header` and one row per label, each printed by `script --case LABEL
    ROUNDS` in its own process: no size inherits the heap (and so the page-fault pattern) that
    a larger one left behind."""
    for key, value in machine_description().items():
        print(f"- {key}: {value}")
    print()
    print(header)
    for label in labels:
        out = subprocess.run([sys.executable, script, "--case", label, str(rounds)], check=True,
                             capture_output=True, text=True)
        print(out.stdout.strip(), flush=True)


def machine_description() -> dict[str, str]:
    def read(path: str) -> str:
        try:
            return Path(path).read_text().strip()
        except OSError:
            return "n/a"

    cpu = "n/a"
    for line in read("/proc/cpuinfo").splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    malloc_env = {k: v for k, v in os.environ.items() if k.startswith(("MALLOC_", "GLIBC_TUNABLES", "LD_PRELOAD"))}
    return {
        "cpu": f"{cpu} x {os.cpu_count()}",
        "base64 kernel": encoder_isa(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "pybase64": pybase64.__version__,
        "libc": " ".join(platform.libc_ver()),
        "malloc env": str(malloc_env or "none set (glibc defaults: dynamic mmap threshold)"),
        "transparent hugepages": read("/sys/kernel/mm/transparent_hugepage/enabled"),
    }
