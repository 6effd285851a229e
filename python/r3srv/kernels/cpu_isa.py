"""What the processor reports about its vector and matrix units, read once: which CPU kernel
each op takes where torch's own kernels compete (kernels/linear_cpu.py). The Rust kernels
choose their own instruction set at run time (`r3srv._core.matrix_isas()`)."""

from __future__ import annotations

import functools
from pathlib import Path


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The flags of the first processor in /proc/cpuinfo (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def torch_has_fast_bfloat16() -> bool:
    """Whether torch's CPU GEMMs run bfloat16 in hardware (oneDNN's AMX or AVX-512 BF16 kernels)
    rather than widening it on the fly at a fraction of their float32 speed."""
    return bool({"amx_bf16", "avx512_bf16"} & cpu_flags())


def torch_has_amx_bfloat16() -> bool:
    """Whether torch's bfloat16 GEMMs and its flash attention (oneDNN's brgemm) run on AMX tiles:
    there they outrun the Rust kernels' AVX-512 BF16 dot products several times over, at every
    size a prefill has (docs/benchmarks.md, "The AMX Xeon")."""
    return "amx_bf16" in cpu_flags()
