"""Decode attention on a GPU: the Triton kernel over the paged cache (kernels/paged_decode_triton.py)
against the torch path (gather each context into a padded copy, SDPA), one layer's decode
step, bf16, checked equal first. Prints one table; run by benches/gpu_check.sh.

    python3 benches/gpu_decode_attention.py
"""

from __future__ import annotations

import os
import sys

import torch

os.environ["R3SRV_TRITON_DECODE"] = "1"  # the kernel is opt-in until measured (models/attention.py)

SHAPES = [  # (sequences, context, heads, kv heads, head dim, window); head dim (576, 512): MLA's latents
    (32, 1024, 32, 4, 128, None),  # Qwen3-30B-A3B-like, a rollout batch
    (64, 4096, 32, 4, 128, None),
    (8, 16384, 32, 4, 128, None),  # few long contexts: the unsplit kernel's weak spot
    (64, 4096, 64, 8, 64, 128),  # gpt-oss's windowed layers
    (64, 4096, 128, 1, (576, 512), None),  # DeepSeek-V3's latent decodes (values: the latent's leading dims)
]
PAGE = 16


def main() -> int:
    if not torch.cuda.is_available():
        print("benches/gpu_decode_attention.py: no CUDA device; nothing measured")
        return 1
    from triton.testing import do_bench

    from r3srv.models.attention import AttentionMetadata, paged_attention
    from r3srv.models.batch import ForwardBatch

    print("| decode step, one layer | kernel | gather + SDPA | ratio |")
    print("|---|---|---|---|")
    for seqs, ctx, heads, kv_heads, dim, window in SHAPES:
        blocks = ctx // PAGE
        order = torch.randperm(seqs * blocks, device="cuda").to(torch.int32)
        dim, v_dim = dim if isinstance(dim, tuple) else (dim, None)
        k_cache = torch.randn(seqs * blocks * PAGE, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
        v_cache = torch.randn_like(k_cache) if v_dim is None else k_cache[..., :v_dim]
        batch = ForwardBatch(
            input_ids=torch.zeros(seqs, dtype=torch.long, device="cuda"),
            positions=torch.full((seqs,), ctx - 1, device="cuda"),
            slot_mapping=order.view(seqs, blocks)[:, -1].long() * PAGE + PAGE - 1,
            query_lens=[1] * seqs, context_lens=[ctx] * seqs, block_tables=order.view(seqs, blocks),
            logits_indices=torch.arange(seqs, device="cuda"),
        )
        meta = AttentionMetadata.build(batch, PAGE, torch.device("cuda"))
        q = torch.randn(seqs, heads, dim, device="cuda", dtype=torch.bfloat16)
        k = k_cache[batch.slot_mapping]
        v = v_cache[batch.slot_mapping]

        def run(kernel: bool):
            return paged_attention(q, k, v, k_cache, v_cache, meta, window=window, decode_kernel=kernel)

        torch.testing.assert_close(run(True).float(), run(False).float(), atol=2e-2, rtol=2e-2)
        fused, gathered = (do_bench(lambda: run(flag), warmup=10, rep=50, return_mode="median") * 1e3
                           for flag in (True, False))
        width = dim if v_dim is None else f"{dim}/{v_dim} (latent)"
        print(f"| {seqs} x {ctx} tokens, {heads}/{kv_heads} heads of {width}{f', window {window}' if window else ''} | "
              f"{fused:.1f} µs | {gathered:.1f} µs | {gathered / fused:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
