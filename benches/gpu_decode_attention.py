"""Decode attention on a GPU: the Triton kernel over the paged cache (kernels/paged_decode_triton.py)
against the torch path (gather each context into a padded copy, SDPA), one layer's decode
step, bf16, checked equal first (every split too). Prints one table: the kernel with the split
it chooses, unsplit, and the best of a sweep of splits (to tune choose_splits); run by
benches/gpu_check.sh.

    python3 benches/gpu_decode_attention.py
    TRITON_INTERPRET=1 python3 benches/gpu_decode_attention.py --smoke  # checks this script on the CPU; numbers mean nothing
"""

from __future__ import annotations

import os
import sys
import time
import traceback

import torch

os.environ.pop("R3SRV_TRITON_DECODE", None)  # "0" would turn the kernel off (r3srv/settings.py)

SHAPES = [  # (sequences, context, heads, kv heads, head dim, window); head dim (576, 512): MLA's latents
    (32, 1024, 32, 4, 128, None),  # Qwen3-30B-A3B-like, a rollout batch
    (64, 4096, 32, 4, 128, None),
    (8, 16384, 32, 4, 128, None),  # few long contexts: the unsplit kernel's weak spot
    (1, 32768, 32, 4, 128, None),  # one long rollout left in the batch
    (64, 4096, 64, 8, 64, 128),  # gpt-oss's windowed layers
    (64, 4096, 128, 1, (576, 512), None),  # DeepSeek-V3's latent decodes (values: the latent's leading dims)
    (4, 8192, 128, 1, (576, 512), None),
]
SMOKE_SHAPES = [(2, 128, 8, 2, 16, None), (1, 256, 4, 1, (24, 16), None), (2, 256, 4, 2, 16, 64)]
SWEEP = (1, 2, 4, 8, 16, 32, 64)
PAGE = 16


def main() -> int:
    smoke = "--smoke" in sys.argv
    torch.manual_seed(0)  # the same inputs on every run
    if smoke and os.environ.get("TRITON_INTERPRET") != "1":
        print("--smoke needs TRITON_INTERPRET=1 (the kernel runs in Triton's interpreter)")
        return 1
    if not smoke and not torch.cuda.is_available():
        print("benches/gpu_decode_attention.py: no CUDA device; nothing measured")
        return 1
    print("| decode step, one layer | kernel (its split) | kernel unsplit | best of a sweep (split) | gather + SDPA | ratio |")
    print("|---|---|---|---|---|---|")
    status = 0
    for shape in SMOKE_SHAPES if smoke else SHAPES:
        try:
            print(measure(*shape, device="cpu" if smoke else "cuda"))
        except Exception as exc:  # one shape's failure must not hide the other rows
            traceback.print_exc()
            print(f"| {shape} | failed: {type(exc).__name__} | | | | |")
            status = 1
    return status


def median_us(fn, device: str) -> float:
    if device == "cpu":  # --smoke: triton's do_bench needs a GPU
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3


def measure(seqs, ctx, heads, kv_heads, dim, window, *, device: str) -> str:
    from r3srv.kernels import paged_decode_triton as kernels
    from r3srv.kernels.launch import cdiv
    from r3srv.ops.attention import AttentionMetadata, paged_attention
    from r3srv.models.batch import ForwardBatch

    blocks = ctx // PAGE
    order = torch.randperm(seqs * blocks, device=device).to(torch.int32)
    dim, v_dim = dim if isinstance(dim, tuple) else (dim, dim)
    k_cache = torch.randn(seqs * blocks * PAGE, kv_heads, dim, device=device, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache) if v_dim == dim else k_cache[..., :v_dim]
    batch = ForwardBatch(
        input_ids=torch.zeros(seqs, dtype=torch.long, device=device),
        positions=torch.full((seqs,), ctx - 1, device=device),
        slot_mapping=order.view(seqs, blocks)[:, -1].long() * PAGE + PAGE - 1,
        query_lens=[1] * seqs, context_lens=[ctx] * seqs, block_tables=order.view(seqs, blocks),
        logits_indices=torch.arange(seqs, device=device),
    )
    meta = AttentionMetadata.build(batch, PAGE, torch.device(device))
    q = torch.randn(seqs, heads, dim, device=device, dtype=torch.bfloat16)
    k, v = k_cache[batch.slot_mapping], v_cache[batch.slot_mapping]
    tables, lens, rows, _ = meta.decode_kernel_args()
    out = torch.empty(seqs, heads, v_dim, device=device, dtype=torch.bfloat16)

    def layer(kernel: bool):
        return paged_attention(q, k, v, k_cache, v_cache, meta, window=window,
                               decode_kernel=kernels.paged_decode_triton if kernel else None)

    def split(parts: int):
        kernels.paged_decode_triton(q, k_cache, v_cache, tables, lens, rows, out, page=PAGE, scale=dim**-0.5,
                                    window=window, splits=parts)
        return out

    want = layer(False).float()
    torch.testing.assert_close(layer(True).float(), want, atol=2e-2, rtol=2e-2)
    visible = min(ctx, window or ctx)
    sweep = [parts for parts in SWEEP if parts == 1 or visible // parts >= 64]
    for parts in sweep:
        torch.testing.assert_close(split(parts).float(), want, atol=2e-2, rtol=2e-2)
    programs = seqs * kv_heads * cdiv(heads // kv_heads, kernels.MIN_DOT)
    chosen = kernels.choose_splits(programs, visible, kernels.processor_count(torch.device(device)))
    fused, gathered = median_us(lambda: layer(True), device), median_us(lambda: layer(False), device)
    swept = {parts: median_us(lambda: split(parts), device) for parts in sweep}
    best = min(swept, key=swept.get)
    width = dim if v_dim == dim else f"{dim}/{v_dim} (latent)"
    return (f"| {seqs} x {ctx} tokens, {heads}/{kv_heads} heads of {width}{f', window {window}' if window else ''} | "
            f"{fused:.1f} µs ({chosen}) | {swept[1]:.1f} µs | {swept[best]:.1f} µs ({best}) | {gathered:.1f} µs | "
            f"{gathered / fused:.2f}x |")


if __name__ == "__main__":
    sys.exit(main())
