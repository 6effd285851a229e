"""The routed-experts encodings besides npy, Rust (r3srv) against their pure-Python references,
per size: SGLang's raw int32 and the prime-rl and SkyRL dicts.

    .venv/bin/python -m pytest benches/bench_formats.py      # pytest-benchmark; ratios at the end
    .venv/bin/python benches/bench_formats.py [rounds]       # the table of docs/encoding.md

The script form runs each size in its own process (no size inherits a larger one's heap) and
times the candidates interleaved round by round (serial_cases.interleaved_medians).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from serial_cases import interleaved_medians, print_table_in_processes  # noqa: E402

from r3srv.serial import encode_packed, encode_raw, packed2json, raw2base64  # noqa: E402
from r3srv.server.rows_encoding import PRIME_RL_DTYPES, SKYRL_DTYPES  # noqa: E402

# (label, rows, experts): uint8 rows of 48 layers x top-8; 512 experts are uint16 rows, whose
# dict dtype needs the largest id read first
CASES = [("1x48x8", 1, 64), ("512x48x8", 512, 64), ("8192x48x8", 8192, 64), ("32768x48x8", 32768, 64),
         ("8192x48x8 (512 experts)", 8192, 512)]
FORMATS = {
    "sglang int32": (lambda a: raw2base64(a, "int32"), lambda a: encode_raw(a, "int32")),
    "prime-rl dict": (lambda a: packed2json(a, PRIME_RL_DTYPES, 3), lambda a: encode_packed(a, PRIME_RL_DTYPES, start=3)),
    "skyrl dict": (lambda a: packed2json(a, SKYRL_DTYPES), lambda a: encode_packed(a, SKYRL_DTYPES)),
}


def make_rows(rows: int, experts: int) -> np.ndarray:
    dtype = np.uint8 if experts <= 256 else np.uint16
    return np.random.default_rng(rows).integers(0, experts, (rows, 48, 8)).astype(dtype)


@pytest.mark.parametrize("candidate", ["reference", "r3srv"])
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("label, rows, experts", [c for c in CASES if c[1] <= 8192],
                         ids=[c[0].replace(" ", "-") for c in CASES if c[1] <= 8192])
def test_encode(benchmark, label, rows, experts, fmt, candidate):
    array = make_rows(rows, experts)
    reference, rust = FORMATS[fmt]
    benchmark.group = f"{fmt} {label}"
    result = benchmark(reference if candidate == "reference" else rust, array)
    assert result == reference(array)


def _fmt(seconds: float) -> str:
    return f"{seconds * 1e6:.2f} µs" if seconds < 1e-3 else f"{seconds * 1e3:.2f} ms"


def row(label: str, rounds: int) -> str:
    _, rows, experts = next(c for c in CASES if c[0] == label)
    array = make_rows(rows, experts)
    cells = []
    for reference, rust in FORMATS.values():
        assert reference(array) == rust(array)
        med = interleaved_medians({"reference": lambda: reference(array), "r3srv": lambda: rust(array)}, rounds)
        cells.append(f"{_fmt(med['reference'])} / {_fmt(med['r3srv'])} = {med['reference'] / med['r3srv']:.1f}x")
    return f"| {label} | " + " | ".join(cells) + " |"


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--case":
        print(row(sys.argv[2], int(sys.argv[3])), flush=True)
        return
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 15
    header = "| rows (reference / rust = speed-up) | " + " | ".join(FORMATS) + " |\n|---|" + "---|" * len(FORMATS)
    print_table_in_processes(__file__, header, [label for label, _, _ in CASES], rounds)


if __name__ == "__main__":
    main()
