"""Decode speed of the built-in model against a base commit, as same-run ratios.

    R3SRV_BASE_REF=<commit> .venv/bin/python -m pytest benches/bench_engine_vs_base.py -s

Checks that a refactor of the engine (the input / core / executor / output split) did not
make decoding slower: one sequence (128 decode steps) and 8 sequences (64 decode steps),
greedy, routed experts on, through `LLM().engine`'s add_request / step, which both trees
have. The base commit is checked out in a temporary git worktree (the compiled Rust
extension copied from this tree); the two trees then run in alternating child processes,
round by round, and the thread-CPU time of a decode step is compared (one torch thread: the
work done, which other processes on a shared machine disturb little; the median step of each
run, the median run of each tree). Skips with the
reason when R3SRV_BASE_REF is unset or cannot be checked out (e.g. a shallow clone).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BASE_REF = os.environ.get("R3SRV_BASE_REF")
ROUNDS = int(os.environ.get("R3SRV_BENCH_ROUNDS", "5"))
SLOWER_LIMIT = 1.03  # head/base CPU time per token above this fails: "not slower", with noise room

CHILD = r"""
import json, sys, time, torch
torch.set_num_threads(1)
from r3srv import LLM, SamplingParams
llm = LLM(max_model_len=512, enable_prefix_caching=False, max_num_seqs=16, enable_return_routed_experts=True)
engine = llm.engine
result = {}
for name, batch, steps in (("single", 1, 128), ("batch8", 8, 64)):
    for repeat in range(2):  # the first pass warms the allocator and caches up
        for i in range(batch):
            prompt = [32 + (i * 17 + j * 13) % 90 for j in range(32)]
            engine.add_request(f"{name}-{repeat}-{i}", prompt, SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True))
        while engine.step().num_prefill_tokens == 0:
            pass
        per_token = []
        while engine.has_unfinished():
            c0 = time.thread_time()
            tokens = engine.step().num_decode_tokens
            per_token.append((time.thread_time() - c0) / tokens)
        result[name] = sorted(per_token)[len(per_token) // 2]  # the median step: robust to a busy neighbour
print("RESULT " + json.dumps(result))
"""


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)


@pytest.fixture(scope="module")
def base_tree():
    if not BASE_REF:  # ten model loads: too long for the untimed smoke pass over every bench
        pytest.skip("set R3SRV_BASE_REF=<commit> (e.g. the commit before an engine change) to compare against it")
    commit = _git("rev-parse", "--verify", f"{BASE_REF}^{{commit}}")
    if commit.returncode != 0:
        pytest.skip(f"base ref {BASE_REF!r} is not available here (set R3SRV_BASE_REF): {commit.stderr.strip()}")
    extension = next((ROOT / "python" / "r3srv").glob("_core*.so"), None)
    if extension is None:
        pytest.skip("the compiled extension python/r3srv/_core*.so is missing (build it first)")
    tmp = Path(tempfile.mkdtemp(prefix="r3srv-base-"))
    tree = tmp / "base"
    added = _git("worktree", "add", "--detach", str(tree), commit.stdout.strip())
    if added.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        pytest.skip(f"cannot check out {BASE_REF!r}: {added.stderr.strip()}")
    shutil.copy2(extension, tree / "python" / "r3srv" / extension.name)
    yield tree
    _git("worktree", "remove", "--force", str(tree))
    shutil.rmtree(tmp, ignore_errors=True)


def _run(tree: Path) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=str(tree / "python"), R3SRV_CPU_THREADS="1")
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=600)
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, done.stderr[-2000:]
    return json.loads(line[len("RESULT "):])


def test_decode_is_not_slower_than_the_base(base_tree):
    runs: dict[str, list[dict[str, float]]] = {"base": [], "head": []}
    for round_no in range(ROUNDS):
        order = [("base", base_tree), ("head", ROOT)]
        for name, tree in order if round_no % 2 == 0 else order[::-1]:  # alternate who goes first
            runs[name].append(_run(tree))
    print(f"\nhead vs {BASE_REF} (thread-CPU time per decoded token, median of {ROUNDS} rounds):")
    for workload in ("single", "batch8"):
        base = statistics.median(r[workload] for r in runs["base"])
        head = statistics.median(r[workload] for r in runs["head"])
        print(f"  {workload:7s} base {base * 1e3:7.3f} ms  head {head * 1e3:7.3f} ms  head/base {head / base:.3f}")
        assert head / base <= SLOWER_LIMIT, f"{workload} decode got slower: head/base = {head / base:.3f}"
