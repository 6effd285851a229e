"""Prints the benchmark table for docs/encoding.md: medians and same-run ratios.

    .venv/bin/python benches/measure_serial.py [rounds]

Each size runs in its own process, so that no size inherits the heap (and so the page-fault
pattern) that a larger one left behind.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from serial_cases import CASES, candidates, interleaved_medians, make_array, print_table_in_processes  # noqa: E402


def fmt(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.2f} µs"
    return f"{seconds * 1e3:.2f} ms"


def row(label: str, rounds: int) -> str:
    shape, dtype = next((shape, dtype) for lab, shape, dtype in CASES if lab == label)
    array = make_array(shape, dtype)
    med = interleaved_medians(candidates(array), rounds)
    ref, rust, bare = med["reference"], med["rust"], med["pybase64 bare"]
    return f"| {label} | {fmt(ref)} | {fmt(rust)} | {fmt(bare)} | {ref / rust:.1f}x | {rust / bare:.2f} |"


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--case":
        print(row(sys.argv[2], int(sys.argv[3])), flush=True)
        return
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 15
    header = "| array | reference | rust | pybase64 bare | rust speed-up | rust / bare |\n|---|---|---|---|---|---|"
    print_table_in_processes(__file__, header, [label for label, _, _ in CASES], rounds)


if __name__ == "__main__":
    main()
