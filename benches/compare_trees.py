"""Speed of the built-in model under this source tree and another one (a base commit),
as same-run ratios: did a change make the engine slower or faster?

    git archive BASE python | tar -x -C /tmp/base && cp python/r3srv/_core*.so /tmp/base/python/r3srv/
    .venv/bin/python benches/compare_trees.py /tmp/base [--rounds 7] [--workloads vllm] [--threads 2] [--dtype bfloat16]

--workloads decode (default): the decode cases below. --workloads vllm: bench_vs_vllm.py's three
(one 512+64-token request; 16 requests of 256+64 at once; one 4,000-token prompt, 1 token out),
timed end to end through LLM.generate, on the process's CPU time (every torch thread's work).

One worker process per tree (PYTHONPATH=<tree>/python, one torch thread), each with its own
built-in engine (routed experts on, prefix caching off), in two pairs started in opposite
orders. Rounds alternate which worker goes first; per round each times a 1-sequence decode (128 steps) and an 8-sequence decode (64 steps)
with bench_engine.timed_decode. Printed: median tokens per thread-CPU second (and wall) per tree
and the ratio this/base; thread CPU time is the work done, which a busy machine barely disturbs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
CASES = {"decode x1": (1, 128), "decode x8": (8, 64)}  # sequences, steps
VLLM_CASES = {"single 512+64": (1, 512, 64), "16 x (256+64)": (16, 256, 64), "prefill 4000": (1, 4000, 1)}


def worker(workloads: str, threads: int, dtype: str) -> None:
    """Serve rounds from stdin: each line a round number, each answer a JSON line of rates."""
    import time

    import torch

    sys.path.insert(0, str(HERE))
    from bench_engine import prompts, timed_decode

    from r3srv import LLM, SamplingParams

    torch.set_num_threads(threads)
    llm = LLM(dtype=dtype, enable_return_routed_experts=True, max_model_len=4096, enable_prefix_caching=False, max_num_seqs=16,
              max_num_batched_tokens=4096)

    def decode(name: str, r: int) -> tuple[float, float]:
        seqs, steps = CASES[name]
        clock, tokens = timed_decode(llm, prompts(seqs, 16, r), steps)
        return tokens / clock.wall, tokens / clock.cpu

    def generate(name: str, r: int) -> tuple[float, float]:
        seqs, prompt_len, out_len = VLLM_CASES[name]
        params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
        w0, c0 = time.perf_counter(), time.process_time()
        outs = llm.generate(prompts(seqs, prompt_len, r), params)
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        assert sum(len(o.outputs[0].token_ids) for o in outs) == seqs * out_len
        return 1 / wall, 1 / cpu  # requests' batches per second

    run, cases = (generate, VLLM_CASES) if workloads == "vllm" else (decode, CASES)
    for name in cases:  # warm-up
        run(name, 9999)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        r = int(line)
        print(json.dumps({name: run(name, r) for name in cases}), flush=True)


def start(tree: Path, workloads: str, threads: int, dtype: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(tree / "python"), R3SRV_CPU_THREADS=str(threads))
    proc = subprocess.Popen([sys.executable, __file__, "--worker", workloads, str(threads), dtype], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert json.loads(proc.stdout.readline())["ready"]
    return proc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base", type=Path, help="the other tree (with python/r3srv and its _core extension)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--workloads", choices=("decode", "vllm"), default="decode")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="the engines' dtype")
    args = parser.parse_args()
    cases = VLLM_CASES if args.workloads == "vllm" else CASES
    unit = "runs" if args.workloads == "vllm" else "tok"
    trees = {"this": HERE.parent, "base": args.base.resolve()}
    rates: dict[str, list[dict]] = {name: [] for name in trees}
    # two pairs of workers, started in opposite orders: the same tree in both workers of a pair
    # measured up to 10% apart depending on which started first (an A/A run)
    for pair, order in enumerate((("this", "base"), ("base", "this"))):
        workers = {name: start(trees[name], args.workloads, args.threads, args.dtype) for name in order}
        for r in range(args.rounds):
            for name in order if r % 2 == 0 else order[::-1]:
                workers[name].stdin.write(f"{pair * args.rounds + r}\n")
                workers[name].stdin.flush()
                rates[name].append(json.loads(workers[name].stdout.readline()))
        for proc in workers.values():
            proc.stdin.close()
            proc.wait()
    for case in cases:
        wall = {n: statistics.median(round_[case][0] for round_ in v) for n, v in rates.items()}
        cpu = {n: statistics.median(round_[case][1] for round_ in v) for n, v in rates.items()}
        print(f"{case}: this {cpu['this']:.2f} {unit}/CPU-s ({wall['this']:.2f} wall), base {cpu['base']:.2f} "
              f"({wall['base']:.2f} wall); this/base {cpu['this'] / cpu['base']:.3f} CPU, "
              f"{wall['this'] / wall['base']:.3f} wall ({2 * args.rounds} rounds)")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    else:
        main()
