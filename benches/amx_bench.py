"""The command line the AMX benches share (bench_amx_experts.py, bench_amx_attention.py): their
--threads and --rounds, the processor's matrix extensions printed, nothing measured (and why
said) where the CPU or Linux does not run AMX tiles."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from r3srv.kernels import cpu_isa


def main(doc: str, runs_here: Callable[[], str | None], measure: Callable[[int, int], None]) -> None:
    """Parses the bench's arguments, prints the flags, then `measure(threads, rounds)` for each
    thread count on torch's threads too, unless `runs_here()` says why not."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, nargs="+", default=[1])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    flags = sorted(f for f in cpu_isa.cpu_flags() if f.startswith(("amx", "avx512_bf16")))
    print(f"processor flags: {' '.join(flags) or 'no AMX or AVX-512 BF16'}")
    why = runs_here()
    if why:
        print(f"skipped: {why}")
        return
    for threads in args.threads:
        torch.set_num_threads(threads)
        measure(threads, args.rounds)
