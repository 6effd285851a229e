"""Which engine default costs what: the engine at its defaults against the same engine with one
set of options changed, in one process, on bench_vs_vllm.py's three workloads.

    .venv/bin/python benches/ab_engine_options.py --rounds 3 \\
        'pool=num_kv_blocks=1024,max_num_seqs=16' 'chunk=max_num_batched_tokens=4096' ...

Each argument is NAME=OPTION=VALUE[,OPTION=VALUE...] (engine options as `LLM(...)` keywords;
values as Python literals). Every engine is built here with the benchmark's dtype and 4,096
context and otherwise r3srv's defaults; rounds alternate the engines' order on fresh prompts
(no cache hits). It prints, per workload and engine, the median CPU seconds the process spent
(time.process_time: every thread of the engine, the work done, which a loaded machine's share
of the cores does not change much) and wall seconds, and the median of the per-round ratios
default / this (> 1: the changed options took less). The thread budget is R3SRV_CPU_THREADS,
as for the server.
"""

from __future__ import annotations

import argparse
import ast
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

from bench_vs_vllm import MAX_MODEL_LEN, WORKLOADS, processor_line  # noqa: E402


def parse_variant(text: str) -> tuple[str, dict]:
    """'name=opt=1,other=True' -> ('name', {'opt': 1, 'other': True})."""
    name, _, options = text.partition("=")
    pairs = (item.split("=", 1) for item in options.split(",") if item)
    return name, {key: ast.literal_eval(value) for key, value in pairs}


def run(variants: dict[str, dict], dtype: str, rounds: int, seed: int = 0) -> dict:
    """`[workload][engine] = (cpu seconds, wall seconds)` lists, one entry per round."""
    from r3srv.engine.llm import LLM
    from r3srv.sampling_params import SamplingParams

    engines = {name: LLM(dtype=dtype, max_model_len=MAX_MODEL_LEN, **options)
               for name, options in {"default": {}, **variants}.items()}
    vocab = next(iter(engines.values())).model_config.vocab_size
    rng = np.random.default_rng(seed)
    took: dict = {}
    for workload, (prompt_len, gen, count, in_flight) in WORKLOADS.items():
        # the engine takes every prompt at once; the server's in-flight limit is the batch here
        batch = min(count, in_flight)
        params = SamplingParams(max_tokens=gen, ignore_eos=True, temperature=0)
        warm = [rng.integers(0, vocab, prompt_len).tolist() for _ in range(batch)]
        for llm in engines.values():
            llm.generate(warm, params)
        for i in range(rounds):
            prompts = [rng.integers(0, vocab, prompt_len).tolist() for _ in range(batch)]
            order = list(engines) if i % 2 == 0 else list(engines)[::-1]
            for name in order:
                cpu, wall = time.process_time(), time.perf_counter()
                engines[name].generate(prompts, params)
                cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
                took.setdefault(workload, {}).setdefault(name, []).append((cpu, wall))
    return took


def print_table(took: dict, variants: dict[str, dict]) -> None:
    for workload, engines in took.items():
        base = engines["default"]
        for name, rounds in engines.items():
            ratios = [b[0] / r[0] for b, r in zip(base, rounds, strict=True)]
            options = ", ".join(f"{k}={v}" for k, v in variants.get(name, {}).items()) or "r3srv's defaults"
            print(f"{workload:10s} {name:10s} cpu {statistics.median(r[0] for r in rounds):.3f} s, wall "
                  f"{statistics.median(r[1] for r in rounds):.3f} s; default/this cpu {statistics.median(ratios):.2f}x "
                  f"({min(ratios):.2f}-{max(ratios):.2f})  [{options}]", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("variants", nargs="+", help="NAME=OPTION=VALUE[,OPTION=VALUE...]")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    variants = dict(parse_variant(v) for v in args.variants)
    print(processor_line(), flush=True)
    print_table(run(variants, args.dtype, args.rounds), variants)


if __name__ == "__main__":
    main()
