"""A CPU decode step against the memory-bandwidth roofline of this machine.

    .venv/bin/python benches/decode_roofline.py [--model DIR] [--dtype float32 bfloat16] [--threads 1 2]

A decode step must read, at least once, every attention, router and LM-head weight, the
weights of each distinct expert its tokens pick (read from the routed-experts rows the engine
returns), and every sequence's keys and values. Those bytes over the machine's measured read
bandwidth (a torch sum over 512 MiB in huge pages, far beyond the caches, on the same threads) are the step's
floor. For 1 and 16 sequences it prints the measured step (mean wall time of the decode
steps), the floor, and each Rust kernel's own time (timers around its calls) against the
floor of the bytes it reads; what is left (Python, small torch ops, the engine's bookkeeping)
has no floor. benches/bench_vs_vllm.py prints this after its table.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from contextlib import contextmanager

import numpy as np
import torch

from r3srv import LLM, SamplingParams, huge_pages, settings
from r3srv.kernels import expert_pairs_cpu, linear_cpu, paged_decode_cpu

PROMPT, STEPS = 256, 48


def median_seconds(threads: int, run, times: int = 5) -> float:
    """Median wall seconds of `run()` on `threads` torch threads, after one untimed call."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        run()
        took = []
        for _ in range(times):
            start = time.perf_counter()
            run()
            took.append(time.perf_counter() - start)
        return statistics.median(took)
    finally:
        torch.set_num_threads(before)


def read_bandwidth(threads: int, mib: int = 512) -> float:
    """Bytes per second a sum over `mib` MiB reads on `threads` torch threads (median of 5), the
    memory in huge pages as the weights are (r3srv.huge_pages, advised before it is written):
    over 4 KiB pages the same sum read a fifth less, slower than the packed expert pass reads
    its weights (docs/benchmarks.md)."""
    data = torch.empty(mib << 18)  # float32
    huge_pages.advise([data])
    data.fill_(1.0)
    return data.numel() * 4 / median_seconds(threads, data.sum)


# the Rust kernels a CPU decode step calls, by the kernel module attribute the callers look up
KERNELS = {"expert pass": (expert_pairs_cpu, "expert_pairs_entry"), "linear layers": (linear_cpu, "linear_entry"),
           "attention": (paged_decode_cpu, "paged_decode_entry")}


@contextmanager
def kernel_timers(seconds: dict[str, float]):
    """Adds each kernel call's wall time to seconds[its name] while in the block."""
    saved = {}
    for name, (module, attr) in KERNELS.items():
        inner = saved[name] = getattr(module, attr)

        def timed(*args, _inner=inner, _name=name, **kwargs):
            start = time.perf_counter()
            try:
                return _inner(*args, **kwargs)
            finally:
                seconds[_name] += time.perf_counter() - start

        setattr(module, attr, timed)
    try:
        yield
    finally:
        for name, (module, attr) in KERNELS.items():
            setattr(module, attr, saved[name])


def weight_bytes(model) -> dict[str, int]:
    """Bytes of the dense weights a decode step reads whole (attention, norms, router gates, LM
    head), and of one expert of one MoE layer (its w13 and w2 rows)."""
    dense, expert = 0, {}
    for name, p in model.named_parameters():
        if "embed" in name:
            continue  # a step reads one row per token
        if name.endswith(("experts.w13", "experts.w2")):
            expert[name] = p.numel() // p.shape[0] * p.element_size()
        else:
            dense += p.numel() * p.element_size()
    layers = len([n for n in expert if n.endswith("w13")])
    return {"dense": dense, "expert": sum(expert.values()) // max(layers, 1)}


def decode_steps(llm: LLM, num_seqs: int, seed: int, timers: dict[str, float] | None = None,
                 kernels: dict[str, float] | None = None) -> tuple[list[float], list[np.ndarray]]:
    """Wall seconds of each decode step of `num_seqs` sequences of PROMPT + STEPS + 1 tokens,
    and each sequence's routed-experts rows; the decode steps' share of `timers` (what
    kernel_timers adds up) is added to `kernels`."""
    engine = llm.engine
    rng = np.random.default_rng(seed)
    vocab = engine.model.config.vocab_size
    for s in range(num_seqs):
        engine.add_request(f"roof-{seed}-{s}", rng.integers(0, vocab, PROMPT).tolist(),
                           SamplingParams(max_tokens=STEPS + 1, temperature=0.0, ignore_eos=True))
    walls, rows = [], {}
    while engine.has_unfinished():
        before = dict(timers or {})
        start = time.perf_counter()
        result = engine.step()
        if result.num_prefill_tokens == 0:
            walls.append(time.perf_counter() - start)
            for name, total in (timers or {}).items():
                kernels[name] += total - before.get(name, 0.0)
        for out in result.outputs:
            if out.finished:
                rows[out.request_id] = out.outputs[0].routed_experts
    return walls, [rows[k] for k in sorted(rows)]


def distinct_experts(rows: list[np.ndarray]) -> float:
    """Mean over decode steps of the distinct (layer, expert) pairs the step's tokens picked:
    row PROMPT + t is the token decode step t feeds."""
    counts = []
    for t in range(STEPS):
        picked = np.stack([r[PROMPT + t] for r in rows])  # [sequences, layers, top_k]
        counts.append(sum(len(np.unique(picked[:, layer])) for layer in range(picked.shape[1])))
    return float(np.mean(counts))


def roofline(model_dir: str | None, dtype: str, threads: int) -> list[str]:
    """The printed lines for one dtype and thread count."""
    lines = []
    with settings.overridden(cpu_threads=threads):
        bandwidth = read_bandwidth(threads)
        llm = LLM(model_dir, dtype=dtype, max_model_len=PROMPT + STEPS + 8, enable_prefix_caching=False,
                  max_num_seqs=16)
        model = llm.engine.model
        sizes = weight_bytes(model)
        attn = [m for m in model.modules() if hasattr(m, "k_cache") and m.k_cache is not None]
        kv_per_token = sum(2 * m.k_cache[0].numel() * m.k_cache.element_size() for m in attn)
        decode_steps(llm, 2, seed=99)  # warm-up
        lines.append(f"decode roofline, {dtype}, {threads} thread(s): read bandwidth {bandwidth / 1e9:.1f} GB/s")
        for num_seqs in (1, 16):
            seconds: dict[str, float] = defaultdict(float)
            decoding: dict[str, float] = defaultdict(float)
            with kernel_timers(seconds):
                walls, rows = decode_steps(llm, num_seqs, seed=num_seqs, timers=seconds, kernels=decoding)
            step = statistics.fmean(walls)
            per_step = {name: decoding[name] / len(walls) for name in KERNELS}
            context = PROMPT + STEPS / 2
            expert_bytes = distinct_experts(rows) * sizes["expert"]
            kv_bytes = num_seqs * context * kv_per_token
            parts = {"expert pass": expert_bytes, "linear layers": sizes["dense"], "attention": kv_bytes}
            floor = sum(parts.values()) / bandwidth
            lines.append(f"  {num_seqs:2d} sequence(s), context ~{context:.0f}: step {step * 1e3:.2f} ms, floor "
                         f"{floor * 1e3:.2f} ms ({sum(parts.values()) / 1e6:.1f} MB) -> {step / floor:.1f}x the floor")
            for name, nbytes in parts.items():
                took, least = per_step[name], nbytes / bandwidth
                lines.append(f"      {name:13s} {took * 1e3:6.2f} ms for {nbytes / 1e6:6.1f} MB: floor {least * 1e3:5.2f} ms "
                             f"({took / least:.1f}x)")
            rest = max(0.0, step - sum(per_step.values()))
            lines.append(f"      {'the rest':13s} {rest * 1e3:6.2f} ms (host side: Python, small torch ops, engine): no floor")
        llm.engine.shutdown()
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint directory (default: the built-in model)")
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    torch.set_num_threads(1)
    for dtype in args.dtype:
        for threads in args.threads:
            print("\n".join(roofline(args.model, dtype, threads)), flush=True)


if __name__ == "__main__":
    main()
