"""Prints the benchmark table for docs/encoding.md: medians and same-run ratios.

    .venv/bin/python benches/measure_serial.py [rounds]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from serial_cases import CASES, candidates, interleaved_medians, machine_description, make_array  # noqa: E402


def fmt(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.2f} µs"
    return f"{seconds * 1e3:.2f} ms"


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 15
    for key, value in machine_description().items():
        print(f"- {key}: {value}")
    print()
    print("| array | reference | rust | pybase64 bare | rust speed-up | rust / bare |")
    print("|---|---|---|---|---|---|")
    for label, shape, dtype in CASES:
        array = make_array(shape, dtype)
        med = interleaved_medians(candidates(array), rounds)
        ref, rust, bare = med["reference"], med["rust"], med["pybase64 bare"]
        print(f"| {label} | {fmt(ref)} | {fmt(rust)} | {fmt(bare)} | {ref / rust:.1f}x | {rust / bare:.2f} |", flush=True)


if __name__ == "__main__":
    main()
