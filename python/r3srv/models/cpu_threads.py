"""How a CPU forward step spends its threads (`--cpu-threads`, settings.cpu_threads).

The Rust kernels (decode attention, the expert pass) split their own work over all of them,
threads taking work from a shared counter or in equal runs, and only when a call is large
enough. torch's OpenMP team gets them only for steps of many tokens (prefills), whose matmuls
and attention are large enough to split: a decode step issues hundreds of small ops, each a
fork and join where every thread waits for the slowest, and on a busy machine for a
descheduled one (docs/benchmarks.md).
"""

from __future__ import annotations

from r3srv import settings

# Fewer tokens than this: torch runs the step on one thread.
TORCH_PARALLEL_MIN_TOKENS = 128


def cpu_torch_threads(num_tokens: int) -> int:
    """torch's intra-op threads for a CPU step of `num_tokens` tokens."""
    return settings.current().cpu_threads if num_tokens >= TORCH_PARALLEL_MIN_TOKENS else 1
