"""Which threads the Rust CPU kernels run on (rust/src/workers.rs): torch's OpenMP team, or a
thread pool of their own.

torch's CPU ops run on GNU OpenMP (libgomp, bundled with its Linux wheels), whose threads spin
after each op before they sleep. Kernels on a pool of their own then share the cores with those
spinning threads, and torch's next op with the pool's (docs/benchmarks.md, "The Rust kernels
on torch's OpenMP threads"). `r3srv serve` makes the OpenMP threads sleep at once
(r3srv/preload.py), which a caller's own process (`LLM(...)`) does not: run on torch's team,
the kernels have nothing to fight either way. Chosen when a CPU model is built (ops/cpu.py),
by `--[no-]openmp-kernel-threads` (R3SRV_OPENMP_KERNEL_THREADS).
"""

from __future__ import annotations

from pathlib import Path

import torch

from r3srv.kernels.rust_core import rust_kernel

_use_openmp_threads = rust_kernel("use_openmp_threads")
_kernel_threads = rust_kernel("kernel_threads")
MAPS = Path("/proc/self/maps")


def torch_openmp_library(maps: Path = MAPS) -> str | None:
    """The GNU OpenMP library torch's ops run on, as this process loaded it, or None: torch's
    parallel backend is not OpenMP, or no libgomp is mapped (another OpenMP, another OS). One
    in torch's own lib directory first (its wheels bundle one)."""
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return None
    try:
        lines = maps.read_text().splitlines()
    except OSError:
        return None
    fields = (line.split(maxsplit=5) for line in lines)  # address, perms, offset, device, inode, path
    loaded = {f[5] for f in fields if len(f) == 6}
    found = sorted(p for p in loaded if Path(p).name.startswith("libgomp"))
    own = Path(torch.__file__).parent / "lib"
    return next((p for p in found if Path(p).parent == own), found[0] if found else None)


def choose(openmp: bool) -> str:
    """Puts the kernels on torch's OpenMP team (`openmp`, where there is one) or on their own
    pool; returns where they run: "openmp", "rayon", or "none" (a build without the switch)."""
    if _use_openmp_threads is None or _kernel_threads is None:
        return "none"
    _use_openmp_threads(torch_openmp_library() if openmp else None)
    return _kernel_threads()
