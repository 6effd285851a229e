"""Paged attention in plain torch: K/V written to slots, context gathered through block tables.

Cache layout per layer: [num_blocks * block_size, num_kv_heads, head_dim] (slot-major), so a
token's K/V lives at its slot and a sequence's context is `slots = table[pos // bs] * bs + pos % bs`.

A step mixes prefills (possibly chunked, possibly after a prefix-cache hit) and decodes.
Decodes (one query token each) share padded SDPA calls, grouped by context length within a
gather budget; each prefill chunk gets its own call with the causal mask shifted by the
tokens already in the cache.
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
class DecodeGroup:
    """Decode sequences (one query token each) attended in one padded SDPA call."""

    rows: torch.Tensor  # [Bg] rows (into T) of the decode tokens
    slots: torch.Tensor  # [Bg, max_context] context slots, padded with slot 0
    mask: torch.Tensor | None  # [Bg, 1, 1, max_context] True where the key is real (None: all real)


# Keys (and as many values) one decode group may gather: the gathered K/V of a group is
# [Bg, max_context, heads, head_dim], so a budget bounds each layer's transient memory
# (64 sequences of 32k tokens would gather 4 GB a layer for a 4-KV-head, 128-dim bf16
# model) and groups sequences of similar length, so short ones are not padded to the longest.
DECODE_GROUP_TOKENS = 1 << 16


@dataclass
class AttentionMetadata:
    """Per-step indices, built once and shared by every layer."""

    slot_mapping: torch.Tensor  # [T]
    decodes: list[DecodeGroup]
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

        decodes = [
            _decode_group(tables, [decode_seqs[j] for j in group], [decode_rows[j] for j in group], batch.context_lens, block_size, device)
            for group in _decode_groups([batch.context_lens[i] for i in decode_seqs])
        ]
        return cls(batch.slot_mapping.to(device), decodes, prefills)


def _decode_groups(context_lens: list[int]) -> list[list[int]]:
    """Indices into `context_lens`, by ascending length, cut so that each group's padded
    gather (members x longest member) stays within DECODE_GROUP_TOKENS (or is one sequence)."""
    groups: list[list[int]] = []
    current: list[int] = []
    for j in sorted(range(len(context_lens)), key=context_lens.__getitem__):
        if current and (len(current) + 1) * context_lens[j] > DECODE_GROUP_TOKENS:
            groups.append(current)
            current = []
        current.append(j)
    if current:
        groups.append(current)
    return groups


def _decode_group(
    tables: torch.Tensor, seqs: list[int], rows: list[int], context_lens: list[int], block_size: int, device
) -> DecodeGroup:
    ctx_lens = [context_lens[i] for i in seqs]
    ctx = torch.tensor(ctx_lens, device=device)
    pos = torch.arange(max(ctx_lens), device=device)  # the max from the host list: no device sync
    real = pos[None, :] < ctx[:, None]
    block_idx = (pos // block_size).clamp(max=tables.shape[1] - 1)
    blocks = tables[torch.tensor(seqs, device=device)][:, block_idx]
    slots = torch.where(real, blocks * block_size + pos % block_size, 0)
    # all of one length (one sequence, say): every gathered key is real, and an unmasked SDPA is faster
    mask = None if min(ctx_lens) == max(ctx_lens) else real[:, None, None, :]
    return DecodeGroup(torch.tensor(rows, device=device), slots, mask)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float | None = None,
) -> torch.Tensor:
    """q [T, H, D], k [T, KVH, D], v [T, KVH, Dv] (this step's tokens) -> attention output [T, H, Dv].

    Writes k/v into the caches at meta.slot_mapping first, so later steps (and prefix-cache
    hits) see them. A v_cache that is a view into k_cache (MLA: the values are the leading
    dims of the cached latent) is written by the k write. scale: the softmax scale (default
    1/sqrt(D)).
    """
    k_cache.index_copy_(0, meta.slot_mapping, k)
    if v_cache.untyped_storage().data_ptr() != k_cache.untyped_storage().data_ptr():
        v_cache.index_copy_(0, meta.slot_mapping, v)
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
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
            qs, ks, vs, attn_mask=span.mask, is_causal=span.mask is None, enable_gqa=gqa, scale=scale
        )
        out[span.start : span.end] = o.squeeze(0).transpose(0, 1)
    for group in meta.decodes:
        qd = q.index_select(0, group.rows).unsqueeze(2)  # [Bg, H, 1, D]
        kd = k_cache[group.slots].transpose(1, 2)  # [Bg, KVH, ctx, D]
        vd = v_cache[group.slots].transpose(1, 2)
        o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=group.mask, enable_gqa=gqa, scale=scale)
        out.index_copy_(0, group.rows, o.squeeze(2))
    return out
