"""One OpenMP team per process: that of the thread that runs the model (the server's core thread).

libgomp counts the threads of every team in the process, and once they outnumber the CPUs it
cuts each one's wait between parallel regions from its spin (300,000 turns unless
OMP_WAIT_POLICY or GOMP_SPINCOUNT say otherwise) to 100 turns: the core thread's team then
falls asleep between a step's kernels and is woken for each (docs/benchmarks.md, "One OpenMP
team"). A team stays with the thread that started it until that thread ends, so the thread
that built the engine (its torch ops ran on the cores) and the server's own threads, were they
to run a parallel torch op, would each keep one.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from r3srv.kernels.kernel_threads import torch_openmp_library

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: the team's threads end, the library stays initialised


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    path = torch_openmp_library()
    return ctypes.CDLL(path) if path is not None else None


def end_team_here() -> bool:
    """Ends the OpenMP team this thread started, if it has one (its threads exit; a later
    parallel op here starts another). Outside any parallel region. False where torch runs on no
    libgomp."""
    lib = _libgomp()
    return lib is not None and lib.omp_pause_resource_all(OMP_PAUSE_SOFT) == 0


def serial_torch_here() -> None:
    """Ends this thread's team and runs its later torch ops on itself alone: for the threads
    beside the core thread (the server's event loop and worker threads), whose torch work is
    small and would otherwise start a team of its own."""
    lib = _libgomp()
    if lib is None:
        return
    torch.get_num_threads()  # torch sets a thread's count from its own on first use: before ours
    end_team_here()
    lib.omp_set_num_threads(1)
