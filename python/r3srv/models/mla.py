"""DeepSeek-V3's multi-head latent attention (MLA) over a paged latent cache.

Each token caches one vector: its normalised KV latent (kv_lora_rank) and its rotated
shared key (qk_rope_head_dim); nothing per head. Two equal ways to attend, as vLLM does:

- Prefills expand the latents of their context into per-head keys and values through
  kv_b_proj (transformers' form): head dims of qk_nope + qk_rope and v_head_dim (192 and 128
  for DeepSeek-V3, against 576 and 512 in the latent space), 3.4x fewer attention FLOPs for
  one extra GEMM over the context.
- Decodes attend in the latent space (the "absorbed" form DeepSeek describes): each head's
  no-RoPE query is multiplied into the latent by its slice of kv_b_proj's key half, scores
  are taken against the cached latent plus rotary key, values are the latent itself, and each
  head's output leaves the latent through the value half: no per-step expansion of the context.

Under the batch-invariant backend (ops/invariant.py) every token, a prompt's too, takes the
decodes' latent form, with the absorptions as per-head linear layers of the backend's, so that
a token's numbers do not depend on how its prompt was chunked or cached.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from r3srv.models.config import ModelConfig
from r3srv.models.dsa import Indexer, Selection
from r3srv.models.layers import empty_param as _param
from r3srv.models.parallel import SINGLE, ColumnParallelLinear, ParallelState, RowParallelLinear, head_pieces, local_heads
from r3srv.ops import REFERENCE, Ops
from r3srv.ops.attention import CAUSAL, AttentionMetadata, attend, paged_attention
from r3srv.ops.rotary import yarn_mscale

# DeepSeek-V3's q_a_layernorm and kv_a_layernorm use RMSNorm's default epsilon, not the config's.
LATENT_NORM_EPS = 1e-6


def mla_softmax_scale(cfg: ModelConfig) -> float:
    """1/sqrt(qk head dim), times YaRN's mscale(factor, mscale_all_dim) squared when set."""
    scale = (cfg.attention.mla.qk_nope_head_dim + cfg.head_dim) ** -0.5
    yarn = cfg.rope.yarn
    if yarn and yarn.get("mscale_all_dim"):
        scale *= yarn_mscale(yarn["factor"], yarn["mscale_all_dim"]) ** 2
    return scale


class MlaAttention(nn.Module):
    """Latent attention over this rank's heads: the latent (kv_a, its norm, the cache) and the
    indexer are whole on every rank, q/kv_b split by heads, o row-parallel."""

    # the whole (unsplit) projections that adapters may target beside the split layers' own
    # slots: name -> r3srv.lora.slots.LoraLinear, filled when the model is served with LoRA
    LORA_WEIGHTS = ("q_a", "kv_a")
    lora_weights: dict = {}
    # kv_b_proj's weight is absorbed into the queries in decode and applied to cached latents in
    # prefill, rows no step's adapter map covers: an adapter on it is refused (docs/lora.md)
    LORA_EXCLUDED = ("kv_b_proj",)

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, index: int = 0,
                 parallel: ParallelState = SINGLE) -> None:
        super().__init__()
        # DeepSeek Sparse Attention: an indexer picks each query's keys, or this layer reuses
        # the selection of the last layer that has one
        spec, mla = cfg.attention, cfg.attention.mla
        sparse = spec.sparse is not None
        self.shares_selection = sparse and index in spec.sparse.shared_layers
        self.indexer = Indexer(cfg, dtype, device) if sparse and not self.shares_selection else None
        # this indexer's place in the step's indexer top-k capture (its layer among those with one)
        self.indexer_slot = spec.sparse.source_layers(index + 1)[index] if sparse else -1
        kw = dict(dtype=dtype, device=device)
        heads = cfg.num_attention_heads
        self.num_heads = local_heads(heads, parallel)
        self.nope, self.rope, self.v_dim, self.rank = mla.qk_nope_head_dim, cfg.head_dim, mla.v_head_dim, mla.kv_lora_rank
        qk = self.nope + self.rope
        hidden = cfg.hidden_size
        q_piece = head_pieces(heads, qk, parallel)
        self.q_a = self.q_a_bias = self.q_a_norm = self.q_b_proj = self.q_proj = None
        if mla.q_lora_rank:
            self.q_a = _param(mla.q_lora_rank, hidden, **kw)
            self.q_a_bias = _param(mla.q_lora_rank, **kw) if spec.qkv_bias else None
            self.q_a_norm = _param(mla.q_lora_rank, **kw)
            self.q_b_proj = ColumnParallelLinear(mla.q_lora_rank, q_piece, **kw)
        else:
            self.q_proj = ColumnParallelLinear(hidden, q_piece, **kw)
        self.kv_a = _param(self.rank + self.rope, hidden, **kw)
        self.kv_a_bias = _param(self.rank + self.rope, **kw) if spec.qkv_bias else None
        self.kv_a_norm = _param(self.rank, **kw)
        self.kv_b_proj = ColumnParallelLinear(self.rank, head_pieces(heads, self.nope + self.v_dim, parallel), **kw)
        self.o_proj = RowParallelLinear(head_pieces(heads, self.v_dim, parallel), hidden, bias=spec.o_bias,
                                        state=parallel, **kw)
        self.scale = mla_softmax_scale(cfg)
        self.rope_layout = "interleaved" if cfg.rope.interleave else "half"
        self.use_rope = cfg.rope.enabled  # Kimi-Linear: no positions (its rope dims stay as they are)
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.use_ops(REFERENCE)

    def use_ops(self, ops: Ops) -> None:
        """The backend's latent norms, rotation and paged decode kernel (latent decodes)."""
        self.rms_norm = ops.norm("default")
        self.rotate = ops.rotate(self.rope_layout)
        self.decode_kernel = ops.decode_attention
        # batch-invariant: the latent projections and absorptions through the backend's linear, every
        # token attended in the latent space (a prompt's through the backend's prefill op, over the latent cache)
        self.latent_linear = ops.linear if ops.batch_invariant else F.linear
        self.latent_prefill = ops.prefill_attention if ops.batch_invariant else None

    def allocate_cache(self, num_slots: int, dtype: torch.dtype, device: torch.device) -> None:
        self.k_cache = torch.zeros(num_slots, 1, self.rank + self.rope, dtype=dtype, device=device)
        self.v_cache = self.k_cache[..., : self.rank]  # the values are the latent itself
        if self.indexer is not None:
            self.indexer.k_cache = torch.zeros(num_slots, self.indexer.dim, dtype=dtype, device=device)

    def free_cache(self) -> None:
        self.k_cache = self.v_cache = None
        if self.indexer is not None:
            self.indexer.k_cache = None

    def weight_targets(self, prefix: str) -> dict[str, torch.Tensor]:
        p = prefix + "self_attn."
        targets = {
            p + "kv_a_proj_with_mqa.weight": self.kv_a,
            p + "kv_a_layernorm.weight": self.kv_a_norm,
            p + "kv_b_proj.weight": self.kv_b_proj.part(),
            p + "o_proj.weight": self.o_proj.part(),
        }
        if self.q_proj is not None:
            targets[p + "q_proj.weight"] = self.q_proj.part()
        else:
            targets.update({p + "q_a_proj.weight": self.q_a, p + "q_a_layernorm.weight": self.q_a_norm,
                            p + "q_b_proj.weight": self.q_b_proj.part()})
        for name, bias in (("q_a_proj", self.q_a_bias), ("kv_a_proj_with_mqa", self.kv_a_bias),
                           ("o_proj", self.o_proj.bias)):
            if bias is not None:
                targets[p + name + ".bias"] = bias
        if self.indexer is not None:
            targets.update(self.indexer.weight_targets(prefix))
        return targets

    def _latent(self, x: torch.Tensor, name: str, bias: torch.Tensor | None) -> torch.Tensor:
        """x through the whole low-rank projection `name` (q_a, kv_a), with its adapters."""
        y = self.latent_linear(x, getattr(self, name), bias)
        lora = self.lora_weights.get(name)
        return y if lora is None else lora(x, y, F.linear)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if self.k_cache is None:
            raise RuntimeError("init_kv_cache(num_blocks, block_size) must be called before forward")
        t, h = x.shape[0], self.num_heads
        q_resid = None
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            q_resid = self.rms_norm(self._latent(x, "q_a", self.q_a_bias), self.q_a_norm, LATENT_NORM_EPS)
            q = self.q_b_proj(q_resid)
        selection: Selection | None = None
        if self.indexer is not None:
            selection = meta.sparse_selection = self.indexer.select(x, q_resid, cos, sin, meta)
            if meta.indexer_capture is not None:
                self.indexer.capture(selection, meta, meta.indexer_capture[:, self.indexer_slot])
        elif self.shares_selection:
            selection = meta.sparse_selection
        q_nope, q_rope = q.view(t, h, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        latent, k_rope = self._latent(x, "kv_a", self.kv_a_bias).split([self.rank, self.rope], dim=-1)
        latent = self.rms_norm(latent, self.kv_a_norm, LATENT_NORM_EPS)
        k_rope = k_rope.reshape(t, 1, self.rope)
        if self.use_rope:
            q_rope, k_rope = self.rotate(q_rope, cos, sin), self.rotate(k_rope, cos, sin)

        key = torch.cat((latent[:, None, :], k_rope), dim=-1)  # [t, 1, rank + rope]: what is cached
        kv_b = self.kv_b_proj.weight.view(h, self.nope + self.v_dim, self.rank)
        all_latent = self.latent_prefill is not None  # batch-invariant: prompts attend in the latent space too
        if meta.decode_seqs or all_latent:  # paged_attention also writes every token's latent
            query = torch.cat((self._absorb(q_nope, kv_b[:, : self.nope], into_latent=True), q_rope), dim=-1)
            groups = None
            if selection is not None:  # sparse attention: each decode gathers its selected keys only
                groups = [g if sparse is None else sparse
                          for g, sparse in zip(meta.decode_groups(None), selection.decodes)]
            out_latent = paged_attention(query, key, key[..., : self.rank], self.k_cache, self.v_cache, meta,
                                         scale=self.scale, decode_kernel=self.decode_kernel,
                                         prefill_kernel=self.latent_prefill, with_prefills=all_latent, groups=groups)
            out = self._absorb(out_latent, kv_b[:, self.nope :], into_latent=False)
            if all_latent:
                return self.o_proj(out.reshape(t, h * self.v_dim))
        else:
            self.k_cache.index_copy_(0, meta.slot_mapping, key)
            out = x.new_empty(t, h, self.v_dim)

        # prefills on expanded keys and values
        if meta.prefills:
            query = torch.cat((q_nope, q_rope), dim=-1)  # [t, h, nope + rope]
            for i, span in enumerate(meta.prefills):
                context = key[span.start : span.end] if span.context_slots is None else (
                    self.k_cache.index_select(0, span.context_slots))
                k, v = self._expand(context)
                qs = query[span.start : span.end].transpose(0, 1).unsqueeze(0)
                mask = CAUSAL if span.mask is None else span.mask
                if selection is not None and selection.prefills[i] is not None:
                    mask = selection.prefills[i]  # the selected keys (a subset of the causal ones)
                o = attend(qs, k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0), mask, False,
                           self.scale, None)
                out[span.start : span.end] = o.squeeze(0).transpose(0, 1)
        return self.o_proj(out.reshape(t, h * self.v_dim))

    def _absorb(self, x: torch.Tensor, w: torch.Tensor, *, into_latent: bool) -> torch.Tensor:
        """Each head's x [t, h, d] through its kv_b part w [h, d, rank] (into_latent: -> [t, h, rank])
        or w [h, v_head_dim, rank] (out of it: x [t, h, rank] -> [t, h, v_head_dim]). Batch-invariant:
        one linear layer of the backend's per head; otherwise one einsum."""
        if self.latent_prefill is None:
            return torch.einsum("thd,hdc->thc" if into_latent else "thc,hdc->thd", x, w)
        return torch.stack([self.latent_linear(x[:, i].contiguous(), (w[i].t() if into_latent else w[i]).contiguous())
                            for i in range(self.num_heads)], dim=1)

    def _expand(self, cached: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached [n, 1, rank + rope] -> per-head keys [n, h, nope + rope] and values [n, h, v_head_dim]."""
        n, h = cached.shape[0], self.num_heads
        k_nope, v = self.kv_b_proj(cached[:, 0, : self.rank]).view(n, h, self.nope + self.v_dim).split(
            [self.nope, self.v_dim], dim=-1)
        k = torch.cat((k_nope, cached[:, :, self.rank :].expand(n, h, self.rope)), dim=-1)
        return k, v.contiguous()
