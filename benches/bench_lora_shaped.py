"""LoRA's cost on a layer of a real model's shape: decode and prefill steps of a Qwen3-30B-A3B-shaped
layer (benches/qwen3_moe_shaped.py: hidden 2,048, 32/4 heads of 128, 128 experts of 768, top-8;
RANDOM weights) with 1, 4 and 16 rank-16 adapters in the batch against the base model alone.

    .venv/bin/python -m pytest benches/bench_lora_shaped.py -s

bench_lora.py measures the same on a tiny model (hidden 64), where a step's fixed costs weigh most:
an upper bound of the relative cost. Here the weights a step reads dominate, as they do serving
a real checkpoint. The adapters target q/k/v/o and the routed experts (transformers 5's stacked
gate_up_proj / down_proj), built in memory as a trainer pushes them (`LoraAdapter`) with random
A and B large enough to change the routing (checked). Routed experts are returned, as in RL.
Two engines in one process at r3srv's default dtype, one torch thread: the base (no
--enable-lora) and one holding the 16 adapters. A workload is 16 sequences, under no adapter or
spread round-robin over 1, 4 or 16 adapters (benches/lora_steps.py); prefill: 4 prompts of 128
tokens in one step; decode: 16 sequences of 16-token prompts, DECODE_STEPS steps timed on their
own. Rounds alternate the workloads' order; the clock is the calling thread's CPU time (wall
printed beside it). The checkpoint (1.2 GB) is written once into `$R3SRV_BENCH_CACHE` (default:
a temporary directory).
"""

from __future__ import annotations

import functools
import os
import re
import tempfile
from pathlib import Path

import pytest
import torch
from lora_steps import decode, prefill, prompts, report, rounds_for, run
from qwen3_moe_shaped import write_checkpoint

from r3srv import LLM, SamplingParams
from r3srv.lora.adapter import LoraAdapter, LoraPair
from r3srv.models.parallel import checkpoint_shape

ROUNDS = int(os.environ.get("R3SRV_BENCH_ROUNDS", "3"))
NUM_ADAPTERS, RANK, BATCH, DECODE_PROMPT, DECODE_STEPS = 16, 16, 16, 16, 8
PREFILL_PROMPTS, PREFILL_LEN = 4, 128
TARGETS = re.compile(r"self_attn\.[qkvo]_proj\.weight$|mlp\.experts\.(gate_up_proj|down_proj)$")


def random_adapter(targets: dict[str, torch.Tensor], seed: int) -> LoraAdapter:
    """A rank-RANK adapter on every target the pattern names, per expert where the target is stacked."""
    gen = torch.Generator().manual_seed(seed)
    pairs = {}
    for name, view in sorted(targets.items()):
        if not TARGETS.search(name):
            continue
        shape = tuple(checkpoint_shape(view))
        experts = shape[:-2]
        a = torch.randn(*experts, RANK, shape[-1], generator=gen) / shape[-1] ** 0.5
        b = torch.randn(*experts, shape[-2], RANK, generator=gen) * 1.5 / RANK ** 0.5
        pairs[name] = LoraPair(a, b)
    return LoraAdapter(pairs, RANK, {"r": RANK})


@pytest.fixture(scope="module")
def setup():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    cache = os.environ.get("R3SRV_BENCH_CACHE")
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_checkpoint(Path(cache or tmp) / "qwen3-30b-a3b-shaped-1", 1)
        common = dict(max_model_len=256, max_num_seqs=BATCH, enable_prefix_caching=False,
                      enable_return_routed_experts=True)
        base = LLM(str(ckpt), **common)
        lora = LLM(str(ckpt), enable_lora=True, max_loras=NUM_ADAPTERS, max_lora_rank=RANK, **common)
        targets = lora.engine.core.executor.runner.model.weight_targets()
        for i in range(NUM_ADAPTERS):
            lora.load_lora_adapter(f"a{i}", adapter=random_adapter(targets, 100 + i))
        yield base, lora
    torch.set_num_threads(before)


def test_adapters_change_the_routing(setup):
    """What the timings run is LoRA: under each adapter the router picks other experts than the
    base's (this random model's greedy tokens barely move: its logits are nearly one-hot)."""
    base, lora = setup
    params = SamplingParams(max_tokens=4, temperature=0.0)
    batch = prompts(4, DECODE_PROMPT, 0)

    def rows(llm, names=None):
        return [o.outputs[0].routed_experts for o in llm.generate(batch, params, lora_name=names)]

    plain = rows(base)
    assert all((a == p).all() for a, p in zip(rows(lora), plain))
    adapted = rows(lora, ["a0", "a1", "a2", "a3"])
    assert all(a.shape == p.shape and (a != p).any() for a, p in zip(adapted, plain))


def test_prefill_steps(benchmark, setup):
    one = functools.partial(prefill, count=PREFILL_PROMPTS, length=PREFILL_LEN)
    times = run(*setup, one, rounds_for(benchmark, ROUNDS))
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    report(f"prefill: {PREFILL_PROMPTS} prompts x {PREFILL_LEN} tokens, one step, {dtype(setup)}", times, 1)


def test_decode_steps(benchmark, setup):
    one = functools.partial(decode, count=BATCH, length=DECODE_PROMPT, steps=DECODE_STEPS)
    times = run(*setup, one, rounds_for(benchmark, ROUNDS))
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    report(f"decode: {BATCH} sequences, {DECODE_STEPS} steps, {dtype(setup)}", times, DECODE_STEPS)


def dtype(setup) -> str:
    return str(setup[0].engine.core.executor.runner.model.dtype).removeprefix("torch.")
