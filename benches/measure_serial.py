"""Prints the benchmark table for docs/encoding.md: medians and same-run ratios.

    .venv/bin/python benches/measure_serial.py [rounds]

Each size runs in its own process, so that no size inherits the heap (and so the page-fault
pattern) that a larger one left behind.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from serial_cases import CASES, candidates, interleaved_medians, machine_description, make_array  # noqa: E402


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
    for key, value in machine_description().items():
        print(f"- {key}: {value}")
    print()
    print("| array | reference | rust | pybase64 bare | rust speed-up | rust / bare |")
    print("|---|---|---|---|---|---|")
    for label, _, _ in CASES:
        out = subprocess.run(
            [sys.executable, __file__, "--case", label, str(rounds)], check=True, capture_output=True, text=True
        )
        print(out.stdout.strip(), flush=True)


if __name__ == "__main__":
    main()
