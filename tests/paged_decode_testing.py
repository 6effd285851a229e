"""Inputs and the torch path's answer for the paged decode attention kernels (Triton's:
tests/paged_decode_cases.py; the CPU's: tests/test_paged_decode_cpu.py)."""

from __future__ import annotations

import torch

from r3srv.ops.attention import attend


def paged_cache(lens, kv_heads, head_dim, v_dim, g, dtype=torch.float32, page: int = 4):
    """A paged cache holding each sequence's context in scattered blocks, and their block tables."""
    blocks = [-(-n // page) for n in lens]
    order = torch.randperm(sum(blocks) + 3, generator=g)[: sum(blocks)]  # 3 blocks nobody owns
    tables = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
    first = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = order[first : first + n]
        first += n
    slots = (sum(blocks) + 3) * page
    k_cache = torch.randn(slots, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(slots, kv_heads, v_dim, generator=g).to(dtype)
    return k_cache, v_cache, tables


def torch_path_decode(q, k_cache, v_cache, tables, lens, rows, scale, window, sinks, page: int = 4):
    """Each sequence's context gathered out of the cache and attended with `attend` (SDPA), at
    its row of a NaN-filled output."""
    out = torch.full((q.shape[0], q.shape[1], v_cache.shape[2]), float("nan"), dtype=q.dtype)
    for i, (n, row) in enumerate(zip(lens, rows)):
        pos = torch.arange(max(0, n - window) if window else 0, n)
        slots = tables[i, pos // page].long() * page + pos % page
        k, v = k_cache[slots].transpose(0, 1)[None], v_cache[slots].transpose(0, 1)[None]
        o = attend(q[row][None, :, None], k, v, None, q.shape[1] != k.shape[1], scale, sinks)
        out[row] = o[0, :, 0]
    return out


# The families and config changes whose decodes the kernels' wiring tests run: GQA, gpt-oss's
# sinks and windows, Mixtral's window, latent attention.
MODEL_CASES = [("qwen3_moe", {}), ("gpt_oss", {"num_layers": 3}), ("mixtral", {"sliding_window": 4}),
               ("deepseek_v3", {}), ("glm4_moe_lite", {})]


def two_sequence_decode_logits(model) -> torch.Tensor:
    """The logits of a prefill of two sequences, then five steps in which both decode together
    (one crossing block boundaries), in a fresh cache."""
    from test_models_paged import BLOCK_SIZE, _batch

    tokens = torch.randint(0, 256, (14,), generator=torch.Generator().manual_seed(1)).tolist()
    model.init_kv_cache(16, BLOCK_SIZE, 4)
    logits = [model.forward(_batch(model, [(tokens[:9], 0, [0, 1, 2, 3]), (tokens[:2], 0, [5, 6])]))]
    for pos in range(9, 14):
        logits.append(model.forward(_batch(model, [(tokens[pos : pos + 1], pos, [0, 1, 2, 3]),
                                                   (tokens[pos - 7 : pos - 6], pos - 7, [5, 6])])))
    return torch.cat(logits)
