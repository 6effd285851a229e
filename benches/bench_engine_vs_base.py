"""Decode speed of the built-in model against a base commit, as same-run ratios.

    R3SRV_BASE_REF=<commit> .venv/bin/python -m pytest benches/bench_engine_vs_base.py -s

Checks that a refactor of the engine (the input / core / executor / output split) did not
make decoding slower: one sequence (128 decode steps) and 8 sequences (64 decode steps),
greedy, routed experts on, through `LLM().engine`'s add_request / step, which both trees
have. The base commit is checked out in a temporary git worktree (the compiled Rust
extension copied from this tree); the two trees then run in alternating child processes,
round by round, and the thread-CPU time of a decode step is compared (one torch thread: the
work done; the median step of each run, the median run of each tree): the whole step, printed,
and the engine's own work in it (the step less the model's forward, sampling and row storing),
gated, since the forward's time swings by tens of percent between processes on a shared
machine while the engine's work is what an engine refactor changes. Skips with the
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
MAX_EXTRA_ENGINE_SHARE = 0.02  # the engine's own added work per decode step, as a share of the base step

CHILD = r"""
import json, sys, time, torch
torch.set_num_threads(1)
from r3srv import LLM, SamplingParams
llm = LLM(max_model_len=512, enable_prefix_caching=False, max_num_seqs=16, enable_return_routed_experts=True)
engine = llm.engine
# The model's own work (forward, sampling, storing the captured rows), wherever the tree keeps it:
# behind the executor (after the engine split) or in the engine (before it).
model_time = [0.0]
def timed(owner, name):
    real = getattr(owner, name)
    def wrapper(*args, **kwargs):
        c0 = time.thread_time()
        try:
            return real(*args, **kwargs)
        finally:
            model_time[0] += time.thread_time() - c0
    setattr(owner, name, wrapper)
if hasattr(engine, "core"):
    import r3srv.engine.executor as sampling_module
    timed(engine.core.executor.runner, "run")
    timed(engine.core.rows, "store")
else:
    import r3srv.engine.llm_engine as sampling_module
    timed(engine.runner, "run")
timed(sampling_module, "sample")
result = {}
for name, batch, steps in (("single", 1, 128), ("batch8", 8, 64)):
    for repeat in range(2):  # the first pass warms the allocator and caches up
        for i in range(batch):
            prompt = [32 + (i * 17 + j * 13) % 90 for j in range(32)]
            engine.add_request(f"{name}-{repeat}-{i}", prompt, SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True))
        while engine.step().num_prefill_tokens == 0:
            pass
        step_times, engine_times = [], []
        while engine.has_unfinished():
            model_time[0] = 0.0
            c0 = time.thread_time()
            engine.step()
            step_times.append(time.thread_time() - c0)
            engine_times.append(step_times[-1] - model_time[0])
        median = lambda xs: sorted(xs)[len(xs) // 2]  # the median step: robust to a busy neighbour
        result[name] = {"step": median(step_times), "engine": median(engine_times)}
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
    print(f"\nhead vs {BASE_REF}, thread-CPU time per decode step, median of {ROUNDS} rounds:")
    print("  (step: everything; engine: the step less the model's forward, sampling and row storing)")
    for workload in ("single", "batch8"):
        got = {}
        for tree in ("base", "head"):
            got[tree] = {part: statistics.median(r[workload][part] for r in runs[tree]) for part in ("step", "engine")}
        base, head = got["base"], got["head"]
        print(f"  {workload:7s} step   base {base['step'] * 1e3:7.3f} ms  head {head['step'] * 1e3:7.3f} ms  "
              f"head/base {head['step'] / base['step']:.3f}")
        print(f"  {workload:7s} engine base {base['engine'] * 1e6:7.0f} us  head {head['engine'] * 1e6:7.0f} us  "
              f"head - base = {(head['engine'] - base['engine']) / base['step']:+.2%} of a step")
        # The forward's time swings by tens of percent between processes on a shared machine, so the
        # gate is the engine's own work per step (what a refactor of the engine changes), as a share of the step.
        extra = (head["engine"] - base["engine"]) / base["step"]
        assert extra <= MAX_EXTRA_ENGINE_SHARE, f"{workload}: the engine's own work grew by {extra:.2%} of a step"
