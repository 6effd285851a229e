"""Decode-step time of the built-in model against a base commit, both trees in ONE process.

    R3SRV_BASE_REF=<commit> .venv/bin/python -m pytest benches/bench_decode_vs_base.py -s

What a change to the host side of a CPU decode step (Python, small torch ops, the kernels'
wrappers) gains: bench_engine_vs_base.py compares child processes, between which the
forward's own time swings by tens of percent on a shared machine; here the base tree's
`r3srv` package is imported next to this tree's (each tree's modules swapped into
sys.modules while it runs; the compiled Rust extension is this tree's, shared), each builds
its engine (afresh every round: where the weights land in memory moves a step by a few
percent), and the two decode the same batch in turns, one step each, so a neighbour's burst
of load meets both. Workloads: 1 and 16 sequences of 256-token prompts decoding 48
steps (contexts of 257-304 tokens), greedy, routed experts on, float32, at 1 and 2 threads
(settings.cpu_threads; R3SRV_BENCH_THREADS, e.g. "1", picks). Printed: each tree's median
decode step (wall clock, the median of its rounds) and the median over rounds of the
same-round ratio base / head (> 1: this tree is faster). The two trees' tokens and
routed-experts rows must be equal. A benchmark, not a speed gate; skips when
R3SRV_BASE_REF is unset or cannot be checked out.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

import pytest
import torch

from bench_engine_vs_base import base_tree  # noqa: F401 (the fixture: the base commit in a temporary worktree)

ROUNDS = int(os.environ.get("R3SRV_BENCH_ROUNDS", "7"))
THREADS = [int(t) for t in os.environ.get("R3SRV_BENCH_THREADS", "1 2").split()]
WORKLOADS = {"1 seq": 1, "16 seqs": 16}
PROMPT, STEPS = 256, 48
ROOT = Path(__file__).resolve().parents[1]


def _r3srv_modules() -> dict:
    return {name: module for name, module in sys.modules.items() if name == "r3srv" or name.startswith("r3srv.")}


class Tree:
    """One tree's r3srv modules and the engine it built. While `active`, its modules are the
    ones in sys.modules and its python/ directory leads sys.path (the imports a call makes
    late resolve to its own tree)."""

    def __init__(self, python_dir: str, core) -> None:
        self.python_dir, self.modules = python_dir, {"r3srv._core": core}
        self.engine = None
        self.rebuild()

    def rebuild(self) -> None:
        """A fresh engine: each round's pair of engines lies elsewhere in memory, so neither tree
        keeps the luckier placement of the weights and caches for the whole run."""
        self.engine = None
        with self.active():
            import r3srv

            self.engine = r3srv.LLM(max_model_len=1024, enable_prefix_caching=False, max_num_seqs=16,
                                    num_kv_blocks=1200, max_num_batched_tokens=4096,
                                    enable_return_routed_experts=True, dtype="float32").engine
            self.settings = sys.modules["r3srv.settings"]
            self.params = r3srv.SamplingParams
        self.threads = None  # the thread count its model's ops were selected for (a tree that has them)

    @contextlib.contextmanager
    def active(self):
        for name in list(_r3srv_modules()):
            del sys.modules[name]
        sys.modules.update(self.modules)
        sys.path.insert(0, self.python_dir)
        try:
            yield
        finally:
            sys.path.remove(self.python_dir)
            self.modules = _r3srv_modules()  # with what this run imported

    def start(self, batch: int, round_no: int) -> None:
        """Add `batch` requests of PROMPT tokens and run their prefill (one step: they fit the step budget)."""
        with self.active():
            engine = self.engine
            for i in range(batch):
                prompt = [32 + (round_no * 31 + i * 17 + j * 13) % 90 for j in range(PROMPT)]
                engine.add_request(f"{round_no}-{batch}-{i}", prompt,
                                   self.params(max_tokens=STEPS + 1, temperature=0.0, ignore_eos=True))
            while engine.step().num_prefill_tokens == 0:
                pass
        self.done = {}

    def step(self, threads: int) -> float:
        """One decode step at `threads` threads: its wall-clock seconds."""
        with self.active():
            current = self.settings.current()
            self.settings.configure(current.replace(cpu_threads=threads))
            model = self.engine.core.executor.runner.model
            if threads != self.threads and hasattr(model, "select_ops"):  # kernels chosen with the model's ops
                model.select_ops()
                self.threads = threads
            try:
                t0 = time.perf_counter()
                step = self.engine.step()
                seconds = time.perf_counter() - t0
            finally:
                self.settings.configure(current)
        self.done.update((o.request_id, o.outputs[0]) for o in step.outputs if o.finished)
        return seconds

    def outputs(self) -> list:
        """Each finished sequence's tokens and routed-experts rows."""
        assert not self.engine.has_unfinished()
        return [(self.done[r].token_ids, self.done[r].routed_experts.tolist()) for r in sorted(self.done)]


def decode_round(trees: dict, batch: int, threads: int, round_no: int) -> dict[str, float]:
    """Both trees decode the same batch step by step in turns (who goes first alternates), so
    a neighbour's burst of load meets both: each tree's median step."""
    steps: dict[str, list[float]] = {"base": [], "head": []}
    for tree in trees.values():
        tree.start(batch, round_no)
    for step_no in range(STEPS):
        for name in ("base", "head") if (round_no + step_no) % 2 else ("head", "base"):
            steps[name].append(trees[name].step(threads))
    assert trees["base"].outputs() == trees["head"].outputs(), "the trees' tokens or routed-experts rows differ"
    return {name: statistics.median(times) for name, times in steps.items()}


@pytest.fixture(scope="module")
def trees(base_tree):  # noqa: F811
    from r3srv import _core  # one Rust extension for both: a PyO3 module initialises once per process

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    here = Tree(str(ROOT / "python"), _core)
    base = Tree(str(base_tree / "python"), _core)
    for tree in (here, base):  # each runs its own sources
        assert Path(tree.modules["r3srv.models.model"].__file__).is_relative_to(tree.python_dir)
    yield {"base": base, "head": here}
    with here.active():
        torch.set_num_threads(threads)


def test_decode_step_against_the_base(trees):
    results: dict[tuple[str, int], dict[str, list[float]]] = {}
    for round_no in range(ROUNDS + 1):  # round 0 warms both up, untimed
        if round_no:
            for tree in trees.values():
                tree.rebuild()
        for threads in THREADS:
            for workload, batch in WORKLOADS.items():
                got = decode_round(trees, batch, threads, round_no)
                if round_no:
                    runs = results.setdefault((workload, threads), {"base": [], "head": [], "ratio": []})
                    runs["base"].append(got["base"])
                    runs["head"].append(got["head"])
                    runs["ratio"].append(got["base"] / got["head"])
    print(f"\ndecode step, head vs {os.environ.get('R3SRV_BASE_REF')}, {ROUNDS} rounds in one process "
          f"(base / head > 1: head is faster):")
    for (workload, threads), runs in results.items():
        base, head = statistics.median(runs["base"]), statistics.median(runs["head"])
        ratios = runs["ratio"]
        print(f"  {workload:8s} {threads} thread(s): base {base * 1e3:6.2f} ms  head {head * 1e3:6.2f} ms  "
              f"base/head {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})")
        assert head > 0 and base > 0
