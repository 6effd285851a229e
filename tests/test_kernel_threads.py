"""The Rust CPU kernels on torch's OpenMP team or on their own pool (kernels/kernel_threads.py,
rust/src/workers.rs): chosen when a CPU model is built, refused for a library that is not a
loaded GNU OpenMP, and the same bits either way: each kernel at 1-3 threads on generated inputs,
and the engine's tokens, logprobs and routed experts."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from engine_testing import GREEDY
from r3srv import LLM, SamplingParams, _core
from r3srv import settings as settings_module
from r3srv.kernels import kernel_threads
from r3srv.kernels.expert_pairs_cpu import expert_pairs
from r3srv.kernels.linear_cpu import MAX_ROWS, linear_rust
from r3srv.ops import ops_for

TORCH_OPENMP = kernel_threads.torch_openmp_library()
needs_openmp = pytest.mark.skipif(TORCH_OPENMP is None, reason="torch here does not run GNU OpenMP (libgomp)")
SILU = SimpleNamespace(name="silu_and_mul", alpha=0.0, limit=0.0)


@pytest.fixture
def restore_team():
    yield
    kernel_threads.choose(settings_module.current().openmp_kernel_threads)


@needs_openmp
def test_a_cpu_model_puts_the_kernels_on_torchs_openmp_team_unless_turned_off(restore_team):
    for openmp, where in ((False, "rayon"), (True, "openmp")):
        with settings_module.overridden(openmp_kernel_threads=openmp):
            ops_for("cpu", torch.float32)
        assert _core.kernel_threads() == where


@needs_openmp
def test_a_library_that_is_not_a_loaded_gnu_openmp_is_refused(restore_team, tmp_path):
    kernel_threads.choose(True)
    missing = tmp_path / "libgomp.so.1"
    not_openmp = _core.__file__  # loaded, but no GOMP_parallel
    for path, match in ((str(missing), "not a library loaded"), (not_openmp, "no GOMP_parallel")):
        with pytest.raises(ValueError, match=match):
            _core.use_openmp_threads(path)
        assert _core.kernel_threads() == "openmp"  # nothing changed


def on_each_team(run) -> dict[tuple[str, int], object]:
    """run(threads) on each team at 1, 2 and 3 threads."""
    results = {}
    for openmp in (False, True):
        where = kernel_threads.choose(openmp)
        for threads in (1, 2, 3):
            results[where, threads] = run(threads)
    return results


@needs_openmp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [12, 700])  # narrow chunks (a decode step's), wide ones (a prompt's)
def test_the_expert_pass_gives_the_same_bits_on_either_team(restore_team, dtype, tokens):
    g = torch.Generator().manual_seed(tokens)
    experts, hidden, inter, top_k = 16, 128, 64, 4
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) / 11).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g) / 8).to(dtype)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]).int()
    weights = torch.rand(tokens, top_k, generator=g)
    results = on_each_team(lambda threads: expert_pairs(x, w13, w2, weights, ids, None, None, None, SILU, threads))
    first = results["rayon", 1]
    assert first is not None and first.isfinite().all()
    assert all(torch.equal(first, r) for r in results.values())


@needs_openmp
def test_a_linear_layer_gives_the_same_bits_on_either_team(restore_team):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(MAX_ROWS, 384, generator=g), torch.randn(1024, 384, generator=g)  # large enough to split
    results = on_each_team(lambda threads: linear_rust(x, w, None, threads))
    assert all(torch.equal(results["rayon", 1], r) for r in results.values())


@needs_openmp
@pytest.mark.slow
def test_the_engine_gives_the_same_tokens_and_rows_on_either_team(restore_team):
    """Prompts long enough for the flash prefill kernel and the wide expert chunks on threads,
    then decode steps (the fused step's kernels)."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 250, n).tolist() for n in (1500, 300, 40)]
    params = SamplingParams(max_tokens=6, logprobs=2, **GREEDY)
    runs = {}
    for openmp in (False, True):
        with settings_module.overridden(cpu_threads=3, openmp_kernel_threads=openmp):
            llm = LLM(dtype="float32", max_model_len=2048, enable_return_routed_experts=True)
            outputs = llm.generate(prompts, params)
            runs[_core.kernel_threads()] = [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.outputs[0].routed_experts)
                                            for o in outputs]
            llm.engine.shutdown()
    assert set(runs) == {"rayon", "openmp"}
    for (ids_a, logprobs_a, rows_a), (ids_b, logprobs_b, rows_b) in zip(runs["rayon"], runs["openmp"], strict=True):
        assert ids_a == ids_b and len(ids_a) == 6 and logprobs_a == logprobs_b
        assert rows_a is not None and np.array_equal(rows_a, rows_b)
