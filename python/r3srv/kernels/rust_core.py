"""The Rust core's CPU kernels, looked up once per kernel module.

A checkout without the built extension (benches/gpu_check.sh's device image) or with one built
before a kernel (a stale `_core*.so` next to newer Python sources, as worktrees that copy it
have) gets None, and the caller keeps its torch path; each kernel's test asserts that a fresh
build has it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

try:
    from r3srv import _core
except ImportError:
    _core = None


def rust_kernel(name: str) -> Callable | None:
    """r3srv._core.`name`, or None where this build lacks it. Each kernel module exposes its
    entry point as `<kernel>_entry`, for the CPU backend's fused decode step
    (ops/cpu_decode.py), which makes the wrappers' checks once per model and step, then calls
    the entry points straight."""
    return getattr(_core, name, None)


# The element types the Rust CPU kernels take, by the name their entry points expect.
RUST_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
