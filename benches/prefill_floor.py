"""A prompt's prefill against the compute floor of this machine.

    .venv/bin/python benches/prefill_floor.py [--model DIR] [--tokens 4000] [--dtype float32 bfloat16] [--threads 1 2]

A prefill must do every multiply-add of the prompt's forward pass: the q/k/v/o projections,
causal attention (each query against itself and the keys before it), the router and each
token's top-k experts, and the LM head for the last token; the last layer's MLP only for the
tokens whose logits are computed (the others' outputs feed nothing, their routing is kept). Those FLOPs over the rate torch's
own GEMM (MKL or oneDNN) reaches on this machine, on the same threads and dtype, are the
prompt's floor: a kernel as fast as a tuned GEMM on every piece would take that long. It prints
the floor and r3srv's engine time for the prompt (one output token, the median of 3) against it;
benches/bench_vs_vllm.py prints the same floor against both servers' long-prompt times.
Qwen3-MoE-shaped configs (the built-in model, benches/qwen3_moe_shaped.py's) only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from decode_roofline import median_seconds


def prompt_flops(config: dict, tokens: int, causal: bool = True, lm_head_tokens: int = 1) -> int:
    """FLOPs (2 per multiply-add) of a `tokens`-token prefill of a Qwen3-MoE config. causal=False
    counts every query against every key (what an unmasked attention multiplies), lm_head_tokens
    the positions whose logits are computed (and so the last layer's MLP runs for)."""
    if config.get("model_type") != "qwen3_moe":
        raise ValueError(f"prompt_flops counts Qwen3-MoE configs, not {config.get('model_type')!r}")
    hidden, heads, kv_heads = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    pairs = tokens * (tokens + 1) // 2 if causal else tokens * tokens  # (query, key) pairs
    macs = 0
    for layer in range(config["num_hidden_layers"]):
        macs += tokens * hidden * (heads + 2 * kv_heads) * head_dim  # q, k, v
        macs += tokens * heads * head_dim * hidden  # o
        macs += 2 * heads * head_dim * pairs  # scores and the weighted values
        step = config.get("decoder_sparse_step", 1)
        dense = layer in config.get("mlp_only_layers", []) or config["num_experts"] == 0 or (layer + 1) % step != 0
        mlp_tokens = lm_head_tokens if layer == config["num_hidden_layers"] - 1 else tokens
        if dense:
            macs += mlp_tokens * 3 * hidden * config["intermediate_size"]
        else:
            macs += tokens * hidden * config["num_experts"]  # router
            macs += mlp_tokens * config["num_experts_per_tok"] * 3 * hidden * config["moe_intermediate_size"]
    macs += lm_head_tokens * hidden * config["vocab_size"]
    return 2 * macs


def gemm_rate(threads: int, dtype: torch.dtype, size: int = 2048) -> float:
    """FLOP/s of torch's own square GEMM of `size` on `threads` threads (median of 5)."""
    a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
    return 2 * size**3 / median_seconds(threads, lambda: a @ b)


def model_config(model_dir: str | None) -> dict:
    """config.json of a checkpoint directory, or of the built-in model."""
    if model_dir is None:
        from r3srv.models.builtin import builtin_config

        return builtin_config()
    return json.loads((Path(model_dir) / "config.json").read_text())


def floor_line(config: dict, tokens: int, dtype: str, threads: int, times: dict[str, float]) -> str:
    """The floor of a `tokens`-token prefill, with each named time (seconds) against it."""
    flops = prompt_flops(config, tokens)
    rate = gemm_rate(threads, getattr(torch, dtype))
    floor = flops / rate
    against = ", ".join(f"{who} {seconds:.2f} s = {seconds / floor:.2f}x" for who, seconds in times.items())
    return (f"prefill floor, {tokens} tokens, {dtype}, {threads} thread(s): {flops / 1e9:.1f} GFLOP at torch's GEMM "
            f"rate {rate / 1e9:.0f} GFLOPS -> {floor:.2f} s; {against}")


def engine_seconds(model_dir: str | None, dtype: str, threads: int, tokens: int) -> float:
    """r3srv's engine time for a fresh `tokens`-token prompt and one output token (median of 3)."""
    import numpy as np

    from r3srv import LLM, SamplingParams, settings

    with settings.overridden(cpu_threads=threads):
        llm = LLM(model_dir, dtype=dtype, max_model_len=tokens + 8, enable_return_routed_experts=True)
        vocab = llm.engine.model.config.vocab_size
        rng = np.random.default_rng(0)
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        times = []
        for _ in range(4):  # the first warms up
            prompt = rng.integers(0, vocab, tokens).tolist()
            start = time.perf_counter()
            llm.generate([prompt], params)
            times.append(time.perf_counter() - start)
        llm.engine.shutdown()
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint directory (default: the built-in model)")
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = model_config(args.model)
    for dtype in args.dtype:
        for threads in args.threads:
            took = engine_seconds(args.model, dtype, threads, args.tokens)
            print(floor_line(config, args.tokens, dtype, threads, {"r3srv engine": took}), flush=True)


if __name__ == "__main__":
    main()
