"""A long schemathesis run over every route (the benchmark tier's, not CI's): the two servers of
tests/schema_fuzzing.py, fuzzed for as long as asked, with an acceptance check besides the CI
checks (a request the schema admits must not be refused, unless vLLM or SGLang refuse it too:
tests/schema_fuzz_hooks.py lists those). Prints each run's summary; exits non-zero on any failure.

    .venv/bin/python benches/schema_fuzz.py --minutes 10 --seed 1      # make fuzz-deep
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from schema_fuzzing import ACCEPTANCE, CHECKS, fuzz_every_route  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="time budget of each of the two runs")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--no-acceptance", action="store_true", help="the CI checks only")
    args = parser.parse_args()
    checks = CHECKS if args.no_acceptance else (*CHECKS, ACCEPTANCE)
    budget = ["--max-time", str(int(args.minutes * 60)), "--seed", str(args.seed)]
    with tempfile.TemporaryDirectory(prefix="r3srv-fuzz-") as workdir:
        runs = fuzz_every_route(Path(workdir), budget, checks)
    for run in runs:
        print(run.summary, "\n")
    return max(run.returncode for run in runs)


if __name__ == "__main__":
    sys.exit(main())
