"""LoRA's cost: decode and prefill steps with 1, 4 and 16 adapters in the batch against the base
model alone, and replacing an adapter in memory against loading it from its directory.

    .venv/bin/python -m pytest benches/bench_lora.py -s

One tiny qwen3_moe checkpoint (tests/tiny_checkpoints.py) and 16 PEFT adapters of rank 8 on
attention (q/k/v/o) and the routed experts (tests/lora_testing.py). Two engines in one process:
the base (no --enable-lora) and one with --enable-lora --max-loras 16 holding all 16 adapters.
On the CPU the adapters' terms run through the Rust pair-projection kernel (r3srv.lora.cpu_kernel).
A workload is 16 sequences: under no adapter (the LoRA engine's own overhead with slots but no
adapter in the step), or spread round-robin over 1, 4 or 16 adapters. Prefill: 16 prompts of 64
tokens, one token each; decode: 16 sequences of 16-token prompts, 32 decode steps timed on their
own. Rounds interleave the workloads, alternating their order, on one torch thread; the clock is
the calling thread's CPU time (the work done, which neighbours on a shared machine barely move),
wall time printed beside it. Printed: each workload's median and its same-run ratio to the base.

Replacement: an adapter pushed from memory (PEFT's config and state dict as a trainer holds them,
through `adapter_from_tensors` and `llm.load_lora_adapter(name, adapter=...)`) against read from its directory
(`llm.load_lora_adapter(name, path)`), alternating, medians of both.

The model is tiny (hidden 64): per-step fixed costs weigh more here than on a real checkpoint, so
the ratios are an upper bound of the adapters' relative cost. A benchmark, not a speed gate;
tokens are checked (each adapter's continuation differs from the base's).
"""

from __future__ import annotations

import functools
import json
import os
import statistics

import pytest
import torch
from lora_steps import clock, decode, prefill, prompts, report, rounds_for, run
from lora_testing import write_adapter, write_checkpoint
from safetensors.torch import load_file

from r3srv import LLM, SamplingParams
from r3srv.lora.manager import adapter_from_tensors

ROUNDS = int(os.environ.get("R3SRV_BENCH_ROUNDS", "5"))
FAMILY, NUM_ADAPTERS, RANK, BATCH = "qwen3_moe", 16, 8, 16
PREFILL_LEN, DECODE_PROMPT, DECODE_STEPS = 64, 16, 32


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("lora_bench")
    ckpt = write_checkpoint(root / "ckpt", FAMILY)
    paths = [write_adapter(root / f"a{i}", FAMILY, seed=100 + i, rank=RANK) for i in range(NUM_ADAPTERS)]
    common = dict(max_model_len=128, block_size=16, num_kv_blocks=512, max_num_seqs=BATCH,
                  max_num_batched_tokens=4096, enable_prefix_caching=False)
    base = LLM(str(ckpt), **common)
    lora = LLM(str(ckpt), enable_lora=True, max_loras=NUM_ADAPTERS, max_lora_rank=RANK, **common)
    for i, path in enumerate(paths):
        lora.load_lora_adapter(f"a{i}", str(path))
    yield base, lora, paths
    torch.set_num_threads(before)


def test_adapters_change_the_tokens(setup):
    """What the timings run is LoRA: each adapter's greedy continuation differs from the base's."""
    base, lora, _ = setup
    params = SamplingParams(max_tokens=8, temperature=0.0)
    batch = prompts(4, DECODE_PROMPT, 0)
    plain = [o.outputs[0].token_ids for o in base.generate(batch, params)]
    same_as_base = [o.outputs[0].token_ids for o in lora.generate(batch, params, lora_name=[None] * 4)]
    adapted = [o.outputs[0].token_ids for o in lora.generate(batch, params, lora_name=["a0", "a1", "a2", "a3"])]
    assert same_as_base == plain
    assert sum(a != p for a, p in zip(adapted, plain)) >= 3


def test_prefill_steps(benchmark, setup):
    one = functools.partial(prefill, count=BATCH, length=PREFILL_LEN)
    times = run(*setup[:2], one, rounds_for(benchmark, ROUNDS))
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    report(f"prefill: {BATCH} prompts x {PREFILL_LEN} tokens, one step", times, 1)


def test_decode_steps(benchmark, setup):
    one = functools.partial(decode, count=BATCH, length=DECODE_PROMPT, steps=DECODE_STEPS)
    times = run(*setup[:2], one, rounds_for(benchmark, ROUNDS))
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    report(f"decode: {BATCH} sequences, {DECODE_STEPS} steps", times, DECODE_STEPS)


def test_replacing_in_memory_against_loading_from_disk(benchmark, setup):
    _, lora, paths = setup
    # what a trainer pushes: PEFT's config and state dict, already in memory
    config = json.loads((paths[1] / "adapter_config.json").read_text())
    tensors = load_file(str(paths[1] / "adapter_model.safetensors"))
    from_disk, from_memory = [], []
    for r in range(max(3, rounds_for(benchmark, ROUNDS) * 2)):
        for source in ("disk", "memory") if r % 2 == 0 else ("memory", "disk"):
            if source == "disk":
                from_disk.append(clock(lambda: lora.load_lora_adapter("a0", str(paths[0])))[0])
            else:
                from_memory.append(clock(lambda: lora.load_lora_adapter(
                    "a0", adapter=adapter_from_tensors(config, tensors)))[0])
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    disk, memory = statistics.median(from_disk), statistics.median(from_memory)
    print(f"\nreplacing a rank-{RANK} adapter (attention + experts), wall clock medians: from its directory "
          f"{1e3 * disk:.2f} ms, from memory {1e3 * memory:.2f} ms ({disk / memory:.1f}x)")
    assert lora.engine.core.lora.ref("a0").version > 1
