"""The server process's start on the CPU: tcmalloc preloaded, as vLLM's CPU backend preloads
it, and torch's OpenMP threads told how to wait between ops.

A CPU step allocates and frees tensors of a megabyte and more (activations, the expert pass's
buffers) every step; glibc's malloc hands such blocks back to the kernel and faults their pages
in again the next step, tcmalloc keeps them (the engine's 64-request throughput run ~10% faster,
docs/benchmarks.md). A malloc must be in LD_PRELOAD before the process starts, so `r3srv serve`
re-executes itself once with it added: an exec, not a child, so the PID a supervisor or test
holds stays the server's. Only on its own command line (never inside a caller's process), when
the library is installed (Debian/Ubuntu: libtcmalloc-minimal4) and no GPU will be used.

torch's Linux wheels run their ops' threads on libgomp, whose threads spin after a parallel
region (300,000 turns), waiting for the next, before they sleep. The Rust kernels run on that
same team (kernels/kernel_threads.py), so a step's regions follow each other on threads that
are already awake: `serve` leaves libgomp's wait as it is (two threads served, bfloat16
throughput 1.29x vLLM-CPU's with it against 0.98x passive, docs/benchmarks.md, "One OpenMP
team"). With the kernels on a pool of their own (`--no-openmp-kernel-threads`), the spinning
team would share the cores with the pool's threads, and `serve` sets OMP_WAIT_POLICY=PASSIVE
(they sleep at once). libgomp reads it when it loads, with torch, so that is set before
anything imports torch; a wait policy or spin count the user set stays.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence

# Where distributions install tcmalloc's allocator-only build.
TCMALLOC_PATHS = (
    "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib64/libtcmalloc_minimal.so.4",
)
# Present when an NVIDIA driver is loaded: `--device auto` will pick the GPU.
NVIDIA_CONTROL_DEVICE = "/dev/nvidiactl"


def tcmalloc_path(paths: Sequence[str] = TCMALLOC_PATHS) -> str | None:
    """The first installed tcmalloc of `paths`, or None."""
    return next((p for p in paths if os.path.exists(p)), None)


def uses_gpu(device: str) -> bool:
    """Whether `--device` will put the model on a GPU (auto: when an NVIDIA driver is loaded)."""
    return device.startswith("cuda") or (device == "auto" and os.path.exists(NVIDIA_CONTROL_DEVICE))


def preload_env(environ: Mapping[str, str], device: str, enabled: bool, library: str | None) -> dict[str, str] | None:
    """The environment to re-execute with (LD_PRELOAD led by `library`), or None to run as is:
    turned off, no library, a GPU run, or tcmalloc already preloaded."""
    preload = environ.get("LD_PRELOAD", "")
    if not enabled or library is None or uses_gpu(device) or "libtcmalloc" in preload:
        return None
    return {**environ, "LD_PRELOAD": f"{library}:{preload}" if preload else library}


def openmp_env(environ: Mapping[str, str], device: str, kernels_on_team: bool) -> dict[str, str]:
    """What the server adds to its environment for torch's OpenMP threads: a passive wait on the
    CPU when the kernels run on a pool of their own (not `kernels_on_team`), unless `environ`
    sets a wait policy or spin count of its own."""
    chosen = "OMP_WAIT_POLICY" in environ or "GOMP_SPINCOUNT" in environ
    if kernels_on_team or uses_gpu(device) or chosen:
        return {}
    return {"OMP_WAIT_POLICY": "PASSIVE"}


def waits_passively(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether torch's OpenMP threads sleep as soon as an op ends: `environ` sets
    OMP_WAIT_POLICY=PASSIVE or GOMP_SPINCOUNT=0 (libgomp read it when torch loaded, in a process
    that set it before, as `serve` does)."""
    policy, spins = environ.get("OMP_WAIT_POLICY", ""), environ.get("GOMP_SPINCOUNT", "")
    return policy.strip().lower() == "passive" or spins.strip() == "0"


def choose_openmp_wait(device: str, kernels_on_team: bool) -> None:
    """Adds `openmp_env`'s choice to this process's environment: call it before torch is imported
    (libgomp reads it once, when torch loads it)."""
    os.environ.update(openmp_env(os.environ, device, kernels_on_team))


def reexec_with_tcmalloc(device: str, enabled: bool) -> None:
    """Replaces this process with its own command line, tcmalloc preloaded, where that applies
    (see `preload_env`); returns otherwise."""
    env = preload_env(os.environ, device, enabled, tcmalloc_path())
    if env is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, env)
