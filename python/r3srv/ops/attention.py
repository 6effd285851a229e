"""Paged attention in plain torch: K/V written to slots, context gathered through block tables.

Cache layout per layer: [num_blocks * block_size, num_kv_heads, head_dim] (slot-major), so a
token's K/V lives at its slot and a sequence's context is `slots = table[pos // bs] * bs + pos % bs`.

A step mixes prefills (possibly chunked, possibly after a prefix-cache hit) and decodes.
Decodes (one query token each) share padded SDPA calls, grouped by context length within a
gather budget; each prefill chunk gets its own call with the causal mask shifted by the
tokens already in the cache (on the CPU, two flash attentions merged by their log-sum-exps:
over the cached keys, nothing masked, and causally over the chunk's own). Sliding-window
layers mask keys more than `window` positions back; attention sinks (gpt-oss) add a learned
per-head logit to every softmax's denominator.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from r3srv.transfer import to_device

if TYPE_CHECKING:
    from r3srv.models.batch import ForwardBatch


@dataclass
class PrefillSpan:
    start: int  # first row of this sequence in the step's T tokens
    end: int
    context_slots: torch.Tensor | None  # [context_len] slots; None when the whole context is this chunk
    context_len: int = 0
    slots: torch.Tensor | None = None  # [q] this span's own tokens' slots
    # a chunk after cached tokens: its first query's position, its causal mask built on first use
    # (the CPU flash kernels never ask for it, and a long prompt's chunk holds millions of entries)
    query_start: int | None = None

    @functools.cached_property
    def mask(self) -> torch.Tensor | None:
        """[q, context_len] bool, True where a query sees a key; None means plain causal (q ==
        context_len)."""
        if self.query_start is None:
            return None
        device = self.context_slots.device
        pos = torch.arange(self.context_len, device=device)
        qpos = torch.arange(self.query_start, self.context_len, device=device)
        return pos[None, :] <= qpos[:, None]  # query i sits at position query_start + i


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
    decodes: list[DecodeGroup] | None  # None: built on first use (decode_groups), as the kernel needs none
    prefills: list[PrefillSpan]
    # to build decode groups of a sliding window on first use (shared by the windowed layers)
    tables: torch.Tensor | None = None
    decode_seqs: list[int] = field(default_factory=list)
    decode_rows: list[int] = field(default_factory=list)
    context_lens: list[int] = field(default_factory=list)
    block_size: int = 0
    windowed: dict[int, list[DecodeGroup]] = field(default_factory=dict)
    # DeepSeek Sparse Attention (models/dsa.py): the last indexer layer's selection, which the
    # layers after it that share it reuse in this step
    sparse_selection: object = None
    # [T, indexer layers, index_topk] int32 (--enable-return-indexer-topk): each indexer layer
    # writes its tokens' selected key positions into its column (models/dsa.py); None: none
    indexer_capture: torch.Tensor | None = None
    # a graph-captured decode step: the longest context is not known on the host when the graph
    # replays, so the kernel's split comes from the bucket and max_model_len
    graph: bool = False
    _decode_kernel_args: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None = None

    def decode_kernel_args(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """The decoding sequences' block tables, context lengths and rows, and the longest
        context (a host int: it decides the kernel's split), for the Triton kernel (built on
        first use, shared by the layers)."""
        if self._decode_kernel_args is None:
            host_lens = [self.context_lens[i] for i in self.decode_seqs]
            seqs, lens, rows = to_device([self.decode_seqs, host_lens, self.decode_rows], self.slot_mapping.device)
            self._decode_kernel_args = (self.tables[seqs], lens, rows, max(host_lens))
        return self._decode_kernel_args

    def decode_groups(self, window: int | None) -> list[DecodeGroup]:
        """The decode groups of a layer whose queries see `window` keys at most: they gather
        only the last `window` keys of each context (O(window) a step, not O(context))."""
        if window is None or all(self.context_lens[i] <= window for i in self.decode_seqs):
            if self.decodes is None:
                self.decodes = self._build_decode_groups(None)
            return self.decodes
        if window not in self.windowed:
            self.windowed[window] = self._build_decode_groups(window)
        return self.windowed[window]

    def _build_decode_groups(self, window: int | None) -> list[DecodeGroup]:
        lens = [self.context_lens[i] if window is None else min(self.context_lens[i], window) for i in self.decode_seqs]
        return [
            _decode_group(self.tables, [self.decode_seqs[j] for j in group], [self.decode_rows[j] for j in group],
                          self.context_lens, self.block_size, self.slot_mapping.device, window)
            for group in _decode_groups(lens)
        ]

    @classmethod
    def build(cls, batch: ForwardBatch, block_size: int, device: torch.device) -> "AttentionMetadata":
        if batch.graph is not None:
            return cls._graph_decode(batch, block_size)
        tables = batch.block_tables.to(device=device, dtype=torch.int64)
        decode_seqs: list[int] = []
        decode_rows: list[int] = []
        prefills: list[PrefillSpan] = []
        slot_mapping = batch.slot_mapping.to(device)
        start = 0
        for i, (q, ctx) in enumerate(zip(batch.query_lens, batch.context_lens)):
            if q <= 0 or ctx < q:
                raise ValueError(f"sequence {i}: query_len={q} must be in 1..context_len={ctx}")
            if q == 1 and ctx > 1:
                decode_seqs.append(i)
                decode_rows.append(start)
            elif q == ctx:
                prefills.append(PrefillSpan(start, start + q, None, ctx, slot_mapping[start : start + q]))
            else:
                pos = torch.arange(ctx, device=device)
                slots = tables[i, pos // block_size] * block_size + pos % block_size
                prefills.append(PrefillSpan(start, start + q, slots, ctx, slot_mapping[start : start + q],
                                            query_start=ctx - q))
            start += q

        return cls(slot_mapping, None, prefills, tables, decode_seqs, decode_rows,
                   list(batch.context_lens), block_size)


    @classmethod
    def _graph_decode(cls, batch: ForwardBatch, block_size: int) -> "AttentionMetadata":
        """A decode step for CUDA-graph capture: the Triton kernel's arguments straight from the
        batch's static tensors (row i is sequence i), no host list read, no transfer."""
        rows = torch.arange(batch.input_ids.shape[0], device=batch.input_ids.device)
        meta = cls(batch.slot_mapping, None, [], batch.block_tables, list(range(len(rows))), [], [], block_size,
                   graph=True)
        meta._decode_kernel_args = (batch.block_tables, batch.graph.context_lens, rows, batch.graph.max_context)
        return meta


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
    tables: torch.Tensor, seqs: list[int], rows: list[int], context_lens: list[int], block_size: int, device,
    window: int | None = None,
) -> DecodeGroup:
    """The group's context slots, padded to its longest; with a window, only each context's
    last `window` positions."""
    ctx_lens = [context_lens[i] for i in seqs]
    firsts = [0 if window is None else max(0, c - window) for c in ctx_lens]
    lens = [c - f for c, f in zip(ctx_lens, firsts)]
    offsets = torch.arange(max(lens), device=device)  # the max from the host list: no device sync
    real = offsets[None, :] < torch.tensor(lens, device=device)[:, None]
    seq_tables = tables[torch.tensor(seqs, device=device)]
    if any(firsts):
        pos = offsets[None, :] + torch.tensor(firsts, device=device)[:, None]
        blocks = torch.gather(seq_tables, 1, (pos // block_size).clamp(max=tables.shape[1] - 1))
    else:  # every context from position 0: one column index for all rows
        pos = offsets[None, :]
        blocks = seq_tables[:, (offsets // block_size).clamp(max=tables.shape[1] - 1)]
    slots = torch.where(real, blocks * block_size + pos % block_size, 0)
    # all of one length (one sequence, say): every gathered key is real, and an unmasked SDPA is faster
    mask = None if min(lens) == max(lens) else real[:, None, None, :]
    return DecodeGroup(torch.tensor(rows, device=device), slots, mask)


# (q, k_cache, v_cache, tables, lens, rows, out, *, page, scale, window, sinks, max_context) -> None:
# a backend's paged decode kernel (the Triton one on CUDA, the Rust one on the CPU), which walks
# the paged cache instead of gathering each context into a padded copy (docs/benchmarks.md,
# "Paged decode attention"); None: the torch path (gather + SDPA)
DecodeKernel = Callable[..., None]


# (q, k, v, k_cache, v_cache, spans, out, *, scale, window, sinks) -> None: the attention of
# every prefill span of a step (its prompts and prompt chunks) in one call, written into out's
# rows of those spans; the step's K/V are in the cache already
PrefillKernel = Callable[..., None]


def span_kernel(kernel, max_context: int | None = None, longer: PrefillKernel | None = None,
                any_length: Callable[..., bool] | None = None) -> PrefillKernel:
    """A backend's variable-length prefill kernel as the prefill op: `kernel(q, k_cache, v_cache,
    columns, slots, out, *, scale, window, sinks)` reads the step's spans as arrays (columns
    [3, spans]: first row, query count, context length; slots: every span's context slots, span
    after span), its keys from the cache, which this step's are written to first. Spans of
    contexts longer than `max_context` (where the kernel is slower) go to `longer`, in its own
    call, unless `any_length(q, window, sinks)` says the kernel takes this call's at any length."""

    def prefill(q, k, v, k_cache, v_cache, spans, out, *, scale=None, window=None, sinks=None) -> None:
        limit = None if any_length is not None and any_length(q, window, sinks) else max_context
        mine = spans if limit is None else [s for s in spans if s.context_len <= limit]
        if len(mine) < len(spans):
            rest = [s for s in spans if s.context_len > limit]
            longer(q, k, v, k_cache, v_cache, rest, out, scale=scale, window=window, sinks=sinks)
        if not mine:
            return
        columns = torch.tensor([[s.start for s in mine], [s.end - s.start for s in mine],
                                [s.context_len for s in mine]], dtype=torch.int64)
        contexts = [s.context_slots if s.context_slots is not None else s.slots for s in mine]
        if any(c is None for c in contexts):
            raise ValueError("a prefill span without its slots (AttentionMetadata.build gives them)")
        kernel(q, k_cache, v_cache, columns, torch.cat(contexts), out,
               scale=q.shape[-1] ** -0.5 if scale is None else scale, window=window, sinks=sinks)

    return prefill


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      spans: list[PrefillSpan], out: torch.Tensor, *, scale: float | None = None,
                      window: int | None = None, sinks: torch.Tensor | None = None, merged: bool = False) -> None:
    """The torch path of the prefill op: each span's causal attention (shifted by its cached
    tokens, within the window, with the sinks) in one SDPA call, over this step's keys or its
    context gathered from the cache. merged: a chunk after cached tokens (no window, no sinks)
    as two flash attentions merged by their log-sum-exps where `_attend_after_cache` takes it
    (the CPU backend's choice: it skips the masked half of the scores)."""
    gqa = q.shape[1] != k.shape[1]
    for span in spans:
        q_len = span.end - span.start
        qs = q[span.start : span.end].transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
        windowed = window is not None and window < span.context_len
        # a windowed chunk after cached tokens reads only the keys its queries can see
        first = max(0, span.context_len - q_len - window + 1) if windowed else 0
        if span.context_slots is None:
            ks = k[span.start : span.end]
            vs = v[span.start : span.end]
        else:
            ks = k_cache.index_select(0, span.context_slots[first:])
            vs = v_cache.index_select(0, span.context_slots[first:])
        ks = ks.transpose(0, 1).unsqueeze(0)
        vs = vs.transpose(0, 1).unsqueeze(0)
        mask = span.mask
        if windowed:
            mask = _window_mask(q_len, span.context_len, window, q.device)[:, first:]
        elif mask is None:
            mask = CAUSAL
        o = None
        if merged and span.context_slots is not None and not windowed and sinks is None:
            o = _attend_after_cache(qs, ks, vs, gqa, scale)
        if o is None:
            o = attend(qs, ks, vs, mask, gqa, scale, sinks)
        out[span.start : span.end] = o.squeeze(0).transpose(0, 1)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    decode_kernel: DecodeKernel | None = None,
    prefill_kernel: PrefillKernel | None = None,
    with_prefills: bool = True,
    groups: list[DecodeGroup] | None = None,
) -> torch.Tensor:
    """q [T, H, D], k [T, KVH, D], v [T, KVH, Dv] (this step's tokens) -> attention output [T, H, Dv].

    Writes k/v into the caches at meta.slot_mapping first, so later steps (and prefix-cache
    hits) see them. A v_cache that is a view into k_cache (MLA: the values are the leading
    dims of the cached latent) is written by the k write. scale: the softmax scale (default
    1/sqrt(D)). window: each query sees the keys at most `window - 1` positions back (a
    sliding-window layer). sinks [H]: each head's sink logit, in every softmax's denominator.
    decode_kernel: the backend's paged decode kernel (Ops.decode_attention), which the decodes take
    over the paged cache instead of gathered groups (None: gathered groups). prefill_kernel: the
    backend's prefill attention (Ops.prefill_attention; None: `prefill_attention`). with_prefills=False:
    only the decodes attend here (MLA expands its prefills itself; every token's K/V is written
    all the same). groups: the decode groups to attend over instead of the metadata's (sparse
    attention's selections; never the kernel's).
    """
    prefill_kernel = prefill_attention if prefill_kernel is None else prefill_kernel
    k_cache.index_copy_(0, meta.slot_mapping, k)
    if v_cache.untyped_storage().data_ptr() != k_cache.untyped_storage().data_ptr():
        v_cache.index_copy_(0, meta.slot_mapping, v)
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    if with_prefills and meta.prefills:
        prefill_kernel(q, k, v, k_cache, v_cache, meta.prefills, out, scale=scale, window=window, sinks=sinks)
    launch = decode_kernel if groups is None and meta.decode_seqs else None
    if launch is None and meta.graph:
        raise RuntimeError("a graph-captured decode step needs the backend's paged decode kernel (CUDA: triton, "
                           "settings.triton_decode on)")
    if launch is not None:
        tables, lens, rows, longest = meta.decode_kernel_args()
        launch(q, k_cache, v_cache, tables, lens, rows, out, page=meta.block_size,
               scale=q.shape[-1] ** -0.5 if scale is None else scale, window=window, sinks=sinks,
               max_context=longest)
        return out
    gqa = q.shape[1] != k.shape[1]
    for group in meta.decode_groups(window) if groups is None else groups:
        qd = q.index_select(0, group.rows).unsqueeze(2)  # [Bg, H, 1, D]
        kd = k_cache[group.slots].transpose(1, 2)  # [Bg, KVH, ctx, D]
        vd = v_cache[group.slots].transpose(1, 2)
        o = attend(qd, kd, vd, group.mask, gqa, scale, sinks)
        out.index_copy_(0, group.rows, o.squeeze(2))
    return out


CAUSAL = "causal"  # attend's mask for a plain causal prefill (SDPA's is_causal)
# The CPU flash attention that also returns each query's log-sum-exp (absent from older torch).
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _attend_after_cache(q, k, v, gqa: bool, scale: float | None) -> torch.Tensor | None:
    """attend() of a prefill chunk after cached tokens (q [1, H, q, D], keys [1, KVH, context,
    D], the chunk's own keys last) as two flash attentions merged by their log-sum-exps: over
    the cached keys with nothing masked, and causally over the chunk's own keys. One call with
    the shifted causal mask computes every masked-out score, about half of a long chunk's.
    None where it does not apply (not the CPU kernel's device or dtypes): the caller masks."""
    if _FLASH_CPU is None or not q.is_cpu or q.dtype not in (torch.float32, torch.bfloat16):
        return None
    if gqa:  # head h reads KV head h // group, as SDPA's enable_gqa
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    cached = k.shape[2] - q.shape[2]
    old, old_lse = _FLASH_CPU(q, k[:, :, :cached], v[:, :, :cached], scale=scale)[:2]
    new, new_lse = _FLASH_CPU(q, k[:, :, cached:], v[:, :, cached:], is_causal=True, scale=scale)[:2]
    top = torch.maximum(old_lse, new_lse)
    w_old, w_new = torch.exp(old_lse - top).unsqueeze(-1), torch.exp(new_lse - top).unsqueeze(-1)
    return ((old.float() * w_old + new.float() * w_new) / (w_old + w_new)).to(q.dtype)


def _window_mask(q_len: int, ctx_len: int, window: int, device) -> torch.Tensor:
    """[q, ctx] bool: for the last q of ctx positions, the keys causally visible within the window."""
    qpos = torch.arange(ctx_len - q_len, ctx_len, device=device)[:, None]
    kpos = torch.arange(ctx_len, device=device)[None, :]
    return (kpos <= qpos) & (kpos > qpos - window)


def attend(q, k, v, mask, gqa: bool, scale: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """q [B, H, q, D], k/v [B, KVH, ctx, D*]; mask: bool (True = visible, broadcast), CAUSAL or None.

    SDPA, or with sinks the same attention written out, each head's sink logit joining the
    softmax's denominator (transformers' gpt-oss reference)."""
    causal = isinstance(mask, str)
    if sinks is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=None if causal else mask, is_causal=causal, enable_gqa=gqa, scale=scale
        )
    heads, q_len, ctx = q.shape[1], q.shape[2], k.shape[2]
    if gqa:
        k = k.repeat_interleave(heads // k.shape[1], dim=1)
        v = v.repeat_interleave(heads // v.shape[1], dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if causal:
        mask = torch.ones(q_len, ctx, dtype=torch.bool, device=q.device).tril(ctx - q_len)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.to(scores.dtype).view(1, heads, 1, 1).expand(scores.shape[0], heads, q_len, 1)
    logits = torch.cat((scores, sink), dim=-1)
    probs = torch.softmax(logits - logits.amax(dim=-1, keepdim=True), dim=-1)[..., :-1]
    return torch.matmul(probs.to(v.dtype), v)
