"""Paged attention in plain torch: K/V written to slots, context gathered through block tables.

Cache layout per layer: [num_blocks * block_size, num_kv_heads, head_dim] (slot-major), so a
token's K/V lives at its slot and a sequence's context is `slots = table[pos // bs] * bs + pos % bs`.

A step mixes prefills (possibly chunked, possibly after a prefix-cache hit) and decodes.
Decodes (one query token each) share one padded SDPA call; each prefill chunk gets its own
call with the causal mask shifted by the tokens already in the cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from r3srv.models.batch import ForwardBatch


@dataclass
class PrefillSpan:
    start: int  # first row of this sequence in the step's T tokens
    end: int
    context_slots: torch.Tensor | None  # [context_len] slots; None when the whole context is this chunk
    mask: torch.Tensor | None  # [q, context_len] bool; None means plain causal (q == context_len)


@dataclass
class AttentionMetadata:
    """Per-step indices, built once and shared by every layer."""

    slot_mapping: torch.Tensor  # [T]
    decode_rows: torch.Tensor | None  # [Bd] rows (into T) of the decode tokens
    decode_slots: torch.Tensor | None  # [Bd, max_context] context slots, padded with slot 0
    decode_mask: torch.Tensor | None  # [Bd, 1, 1, max_context] True where the key is real (None: all real)
    prefills: list[PrefillSpan]

    @classmethod
    def build(cls, batch: ForwardBatch, block_size: int, device: torch.device) -> "AttentionMetadata":
        tables = batch.block_tables.to(device=device, dtype=torch.int64)
        decode_seqs: list[int] = []
        decode_rows: list[int] = []
        prefills: list[PrefillSpan] = []
        start = 0
        for i, (q, ctx) in enumerate(zip(batch.query_lens, batch.context_lens)):
            if q <= 0 or ctx < q:
                raise ValueError(f"sequence {i}: query_len={q} must be in 1..context_len={ctx}")
            if q == 1 and ctx > 1:
                decode_seqs.append(i)
                decode_rows.append(start)
            elif q == ctx:
                prefills.append(PrefillSpan(start, start + q, None, None))
            else:
                pos = torch.arange(ctx, device=device)
                slots = tables[i, pos // block_size] * block_size + pos % block_size
                # query i sits at position ctx - q + i and sees keys 0..that position
                qpos = torch.arange(ctx - q, ctx, device=device)
                prefills.append(PrefillSpan(start, start + q, slots, pos[None, :] <= qpos[:, None]))
            start += q

        decode_slots = decode_mask = rows = None
        if decode_seqs:
            ctx_lens = [batch.context_lens[i] for i in decode_seqs]
            ctx = torch.tensor(ctx_lens, device=device)
            pos = torch.arange(max(ctx_lens), device=device)  # the max from the host list: no device sync
            real = pos[None, :] < ctx[:, None]
            block_idx = (pos // block_size).clamp(max=tables.shape[1] - 1)
            seq_tables = tables[torch.tensor(decode_seqs, device=device)]
            blocks = seq_tables[:, block_idx]
            decode_slots = torch.where(real, blocks * block_size + pos % block_size, 0)
            # one decode sequence: every gathered key is real, and an unmasked SDPA is faster
            decode_mask = real[:, None, None, :] if len(decode_seqs) > 1 else None
            rows = torch.tensor(decode_rows, device=device)
        return cls(batch.slot_mapping.to(device), rows, decode_slots, decode_mask, prefills)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
) -> torch.Tensor:
    """q [T, H, D], k/v [T, KVH, D] (this step's tokens) -> attention output [T, H, D].

    Writes k/v into the caches at meta.slot_mapping first, so later steps (and prefix-cache
    hits) see them.
    """
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    out = torch.empty_like(q)
    gqa = q.shape[1] != k.shape[1]
    for span in meta.prefills:
        qs = q[span.start : span.end].transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
        if span.context_slots is None:
            ks = k[span.start : span.end]
            vs = v[span.start : span.end]
        else:
            ks = k_cache.index_select(0, span.context_slots)
            vs = v_cache.index_select(0, span.context_slots)
        ks = ks.transpose(0, 1).unsqueeze(0)
        vs = vs.transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=span.mask, is_causal=span.mask is None, enable_gqa=gqa
        )
        out[span.start : span.end] = o.squeeze(0).transpose(0, 1)
    if meta.decode_rows is not None:
        qd = q.index_select(0, meta.decode_rows).unsqueeze(2)  # [Bd, H, 1, D]
        kd = k_cache[meta.decode_slots].transpose(1, 2)  # [Bd, KVH, ctx, D]
        vd = v_cache[meta.decode_slots].transpose(1, 2)
        o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, enable_gqa=gqa)
        out.index_copy_(0, meta.decode_rows, o.squeeze(2))
    return out
