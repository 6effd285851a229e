"""CPU routing: the Rust kernel (r3srv.kernels.router_cpu) against route_reference, as same-run
ratios.

    .venv/bin/python -m pytest benches/bench_router_cpu.py -s -p no:randomly

(a) one call of the CPU backend's route function with the setting on and off, 64 experts, top-8, softmax,
    renormalized, ids captured into one layer of a uint8 buffer (the built-in model's routing)
    for 1, 16 and 4096 tokens: benches/conftest.py prints reference / Rust as reference / r3srv;
(b) the built-in model's decode step of 1 and 8 sequences with the setting on and off,
    interleaved round by round (bench_expert_pairs_cpu's interleaved_decode_steps): median
    thread-CPU and wall time per step.
Both check the kernel's results against the reference's (the same greedy tokens in (b)).
"""

from __future__ import annotations

import pytest
import torch

from bench_expert_pairs_cpu import decode_step_report, interleaved_decode_steps, modules_with
from r3srv import LLM, settings
from r3srv.kernels.router_reference import route_reference
from r3srv.ops import ops_for
from r3srv.ops.router import RouterShape

EXPERTS, TOP_K, LAYERS = 64, 8, 4

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def route_function(on: bool):
    """The CPU backend's route function for the built-in model's layers, the kernel on or off."""
    with settings.overridden(rust_router=on, force_torch_router=False):
        return ops_for("cpu", torch.float32).router(RouterShape(EXPERTS, TOP_K))


@pytest.mark.parametrize("candidate", ["reference", "r3srv"])
@pytest.mark.parametrize("tokens", [1, 16, 4096])
def test_route(benchmark, tokens, candidate):
    logits = torch.randn(tokens, EXPERTS, generator=torch.Generator().manual_seed(tokens))
    capture = torch.zeros(tokens, LAYERS, TOP_K, dtype=torch.uint8)
    benchmark.group = f"route {tokens} x {EXPERTS} experts, top-{TOP_K}"
    weights, ids = benchmark(route_function(candidate == "r3srv"), logits, TOP_K, capture=capture[:, 1])
    want_weights, want_ids = route_reference(logits, TOP_K)
    assert torch.equal(ids, want_ids) and torch.equal(capture[:, 1].int(), want_ids)
    torch.testing.assert_close(weights, want_weights, rtol=1e-6, atol=1e-7)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_model_len=512, enable_prefix_caching=False, max_num_seqs=8)


@pytest.mark.parametrize("num_seqs", [1, 8])
def test_decode_step(benchmark, llm, num_seqs):
    med = interleaved_decode_steps(benchmark, llm, num_seqs, modules_with(llm, rust_router=None,
                                                                          force_torch_router=False))
    print(decode_step_report(med, num_seqs, off="reference", on="Rust"))
