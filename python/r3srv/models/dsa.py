"""DeepSeek Sparse Attention's indexer (DeepSeek-V3.2, GLM-5): which keys each query attends to.

A light scorer beside multi-head latent attention: per token it caches one index key (a
LayerNorm'd projection, partly rotated); a query's score for key j is
sum_h w_h * relu(q_h . k_j / sqrt(d)), and the query attends to its `index_topk` best keys
among those it can see causally. A context no longer than index_topk is attended densely (every
visible key is selected), so the indexer only runs where it selects. GLM-5's "shared" layers
reuse the selection of the last layer with an indexer.

A prefill span's selection is a boolean mask [q, context] over the keys it already gathers;
a decode group's is a smaller decode group: each sequence gathers only its selected keys, so a
decode attends over index_topk keys whatever its context (ops/attention.py's groups).
None where dense.

With --enable-return-indexer-topk each indexer layer also writes every token's selected key
positions (ascending, -1 after them) into the step's capture: `Indexer.capture`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from r3srv.models.config import ModelConfig
from r3srv.models.layers import empty_param as _param
from r3srv.ops import REFERENCE, Ops
from r3srv.ops.attention import AttentionMetadata, DecodeGroup

# Index scores one prefill chunk computes at once (query rows x heads x context keys): bounds
# the transient memory of long prompts over long contexts.
SCORE_ELEMENTS = 1 << 24


@dataclass
class Selection:
    prefills: list[torch.Tensor | None]  # per meta.prefills span: [q, ctx] bool, True = attended
    decodes: list[DecodeGroup | None]  # per decode group (meta.decode_groups): the group over its selected keys
    # per decode group: [Bg, topk] the picked columns, its contexts' positions (a short context's
    # picks of padding are where the selected group's mask is False)
    decode_positions: list[torch.Tensor | None] | None = None


class Indexer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        spec = cfg.attention.sparse
        self.heads, self.dim, self.topk = spec.n_heads, spec.head_dim, spec.topk
        self.rope = cfg.head_dim  # the rotary width of MLA's keys; the indexer rotates its leading dims
        self.wq_b = _param(self.heads * self.dim, cfg.attention.mla.q_lora_rank, **kw)
        self.wk = _param(self.dim, cfg.hidden_size, **kw)
        self.k_norm = _param(self.dim, **kw)
        self.k_norm_bias = _param(self.dim, **kw)
        self.weights_proj = _param(self.heads, cfg.hidden_size, **kw)
        self.rope_layout = "interleaved" if spec.rope_interleave else "half"
        self.scale = self.dim**-0.5
        self.k_cache: torch.Tensor | None = None  # [slots, dim]
        self.use_ops(REFERENCE)

    def use_ops(self, ops: Ops) -> None:
        self.rotate = ops.rotate(self.rope_layout)

    def weight_targets(self, prefix: str) -> dict[str, torch.Tensor]:
        p = prefix + "self_attn.indexer."
        return {p + "wq_b.weight": self.wq_b, p + "wk.weight": self.wk, p + "k_norm.weight": self.k_norm,
                p + "k_norm.bias": self.k_norm_bias, p + "weights_proj.weight": self.weights_proj}

    def _rotated(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [t, heads, dim] with its leading rope dims rotated (the rest pass through)."""
        return torch.cat((self.rotate(x[..., : self.rope], cos, sin), x[..., self.rope :]), dim=-1)

    def select(self, x, q_resid, cos, sin, meta: AttentionMetadata) -> Selection:
        """Writes this step's index keys, then picks each query's keys (x [t, hidden], q_resid
        [t, q_lora_rank]: MLA's normalised low-rank query)."""
        t = x.shape[0]
        key = F.layer_norm(F.linear(x, self.wk), (self.dim,), self.k_norm, self.k_norm_bias, 1e-6)
        key = self._rotated(key.view(t, 1, self.dim), cos, sin).view(t, self.dim)
        self.k_cache.index_copy_(0, meta.slot_mapping, key)
        sparse_prefill = any(span.context_len > self.topk for span in meta.prefills)
        sparse_decode = any(meta.context_lens[i] > self.topk for i in meta.decode_seqs)
        if not (sparse_prefill or sparse_decode):
            dense = [None] * len(meta.decode_groups(None))
            return Selection([None] * len(meta.prefills), dense, dense)
        query = self._rotated(F.linear(q_resid, self.wq_b).view(t, self.heads, self.dim), cos, sin).float()
        weights = F.linear(x, self.weights_proj).float() * self.heads**-0.5  # [t, heads]
        prefills = [self._prefill(span, query, weights, key) for span in meta.prefills]
        decodes = [self._decode(group, query, weights) for group in meta.decode_groups(None)]
        return Selection(prefills, [d[0] for d in decodes], [d[1] for d in decodes])

    def _prefill(self, span, query, weights, key) -> torch.Tensor | None:
        ctx, q_len = span.context_len, span.end - span.start
        if ctx <= self.topk:
            return None
        keys = (key[span.start : span.end] if span.context_slots is None else self.k_cache[span.context_slots]).float()
        qpos = torch.arange(ctx - q_len, ctx, device=keys.device)
        visible = torch.arange(ctx, device=keys.device)[None, :] <= qpos[:, None]
        selected = torch.zeros(q_len, ctx, dtype=torch.bool, device=keys.device)
        rows = max(1, SCORE_ELEMENTS // (self.heads * ctx))
        for lo in range(0, q_len, rows):
            hi = min(lo + rows, q_len)
            scores = self._scores(query[span.start + lo : span.start + hi], weights[span.start + lo : span.start + hi],
                                  keys[None])
            scores = scores.masked_fill(~visible[lo:hi], float("-inf"))
            # exact ties go as torch.topk breaks them, which differs between the CPU and CUDA
            # (so do the reference implementations'); a real indexer's 32-64 relu'd heads make
            # them vanishingly rare
            picked = scores.topk(self.topk, dim=-1).indices
            selected[lo:hi].scatter_(1, picked, True)
        return selected & visible

    def _decode(self, group: DecodeGroup, query, weights) -> tuple[DecodeGroup | None, torch.Tensor | None]:
        real = group.slots.new_ones(group.slots.shape, dtype=torch.bool) if group.mask is None else group.mask[:, 0, 0]
        if real.shape[1] <= self.topk:
            return None, None
        keys = self.k_cache[group.slots].float()  # [Bg, ctx, dim]
        scores = self._scores(query[group.rows], weights[group.rows], keys)
        picked = scores.masked_fill(~real, float("-inf")).topk(self.topk, dim=-1).indices  # [Bg, topk]
        # a context shorter than topk picks padding too; a group of one length has none (known
        # on the host: no device sync in the decode path)
        mask = None if group.mask is None else real.gather(1, picked)[:, None, None, :]
        return DecodeGroup(group.rows, group.slots.gather(1, picked), mask), picked

    def capture(self, selection: Selection, meta: AttentionMetadata, out: torch.Tensor) -> None:
        """Every token's selected key positions into out [t, topk] (int32): ascending, then -1
        where fewer than topk were visible. A dense context's are all of its visible positions."""
        cols = torch.arange(self.topk, device=out.device)
        for span, selected in zip(meta.prefills, selection.prefills):
            ctx, q_len = span.context_len, span.end - span.start
            if selected is None:
                qpos = torch.arange(ctx - q_len, ctx, device=out.device)
                out[span.start : span.end] = torch.where(cols[None, :] <= qpos[:, None], cols[None, :], -1)
                continue
            keys = torch.arange(ctx, device=out.device)
            first = torch.where(selected, keys[None, :], ctx).sort(dim=1).values[:, : self.topk]
            out[span.start : span.end] = first.masked_fill(first == ctx, -1)
        for group, sparse, positions in zip(meta.decode_groups(None), selection.decodes, selection.decode_positions):
            if positions is None:  # dense: every real key
                lens = group.slots.shape[1] if group.mask is None else group.mask[:, 0, 0].sum(dim=1, keepdim=True)
                out[group.rows] = torch.where(cols[None, :] < lens, cols[None, :], -1).to(out.dtype)
                continue
            big = torch.iinfo(positions.dtype).max  # padding picked by a short context sorts last
            ordered = positions if sparse.mask is None else positions.masked_fill(~sparse.mask[:, 0, 0], big)
            ordered = ordered.sort(dim=1).values
            out[group.rows] = ordered.masked_fill(ordered == big, -1).to(out.dtype)

    def _scores(self, query, weights, keys) -> torch.Tensor:
        """query [n, heads, dim], weights [n, heads], keys [n or 1, ctx, dim] -> [n, ctx]."""
        per_head = F.relu(torch.einsum("nhd,ncd->nhc", query, keys.expand(query.shape[0], -1, -1)) * self.scale)
        return torch.einsum("nh,nhc->nc", weights, per_head)
