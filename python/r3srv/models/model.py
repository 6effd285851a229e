"""The MoE decoder shared by every family (models/families/: Qwen2/3-MoE, Qwen3-Next and Qwen3.5,
Mixtral, OLMoE, GLM-4.5, 4.7-Flash and 5, MiniMax-M2, DeepSeek-V2/V3/V3.2, gpt-oss, ERNIE-4.5,
dots.llm1, Nemotron-H, Kimi-Linear, Granite-4.0-H and 3.x MoE, AFMoE, LFM2-MoE, Qwen3-VL-MoE, ...).

One class built from the config's typed specs (models/specs.py) rather than a class per
family: the families differ only in q/k norm width, qkv bias/clipping, rotary layout, sliding
windows and sinks, the router (scoring, bias, groups, renormalisation, scaling), the experts'
activation and biases, the shared expert, the checkpoint names (each family module's
`weight_targets`) and the token mixer:
multi-head latent attention for DeepSeek and GLM-4.7-Flash/5 (models/mla.py, sparse with
models/dsa.py), Gated DeltaNet, Kimi Delta Attention or Mamba-2 layers in the hybrids
(models/gated_deltanet.py, models/kda.py, models/mamba2.py). Nemotron-H's
layers are one mixer each (MixerBlock: Mamba-2, models/mamba2.py, attention, MoE or MLP).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from r3srv.models.batch import ForwardBatch
from r3srv.errors import ConfigError
from r3srv.models.config import ModelConfig
from r3srv.models.families import family_named
from r3srv.models.gated_deltanet import GatedDeltaNet
from r3srv.models.kda import KimiDeltaAttention
from r3srv.models.layers import at_rows
from r3srv.models.layers import empty_param as _param
from r3srv.models.layers import move_parameters
from r3srv.models.mamba2 import Mamba2
from r3srv.models.mla import MlaAttention
from r3srv.models.mrope import mrope_cos_sin
from r3srv.models.moe import Mlp, SparseMoeBlock
from r3srv.models.parallel import (SINGLE, ColumnParallelLinear, ParallelLMHead, ParallelState, RowParallelLinear,
                                   VocabParallelEmbedding, column_weight, head_pieces, local_heads)
from r3srv.models.recurrent import LinearStateBatch
from r3srv.models.short_conv import ShortConv
from r3srv.ops import REFERENCE, Declined, Ops, ops_for
from r3srv.ops.attention import AttentionMetadata, paged_attention
from r3srv.ops.norm import norm_kind
from r3srv.ops.parts import AttentionParts, DecoderParts, NormParts
from r3srv.ops.rotary import rope_cos_sin, rope_inv_freq, yarn_inv_freq

log = logging.getLogger(__name__)


# the layers with a per-sequence state, by LinearAttentionSpec.kind
LINEAR_LAYERS = {"gated_deltanet": GatedDeltaNet, "kda": KimiDeltaAttention, "mamba2": Mamba2, "short_conv": ShortConv}


class Attention(nn.Module):
    """Grouped-query attention over this rank's heads (all of them at size 1; KV heads are
    replicated where there are fewer than ranks)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, window: int | None = None,
                 index: int = 0, parallel: ParallelState = SINGLE) -> None:
        super().__init__()
        self.window = window  # a sliding-window layer: keys at most window - 1 positions back
        kw = dict(dtype=dtype, device=device)
        spec = cfg.attention
        heads, kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_kv_heads, cfg.head_dim
        self.num_heads, self.num_kv_heads = local_heads(heads, parallel), local_heads(kv_heads, parallel)
        self.total_heads, self.total_kv_heads, self.parallel = heads, kv_heads, parallel
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.eps = cfg.norm.eps
        self.norm_kind = norm_kind(cfg.norm)
        self.qk_norm = spec.qk_norm
        self.clip_qkv = spec.clip_qkv
        # Qwen3-Next / 3.5: q_proj yields [q, gate] per head; the gate scales the attention output
        self.q_rows = 2 * self.q_size if spec.output_gate else self.q_size
        # q, k and v stacked: one matmul per layer
        q_piece = head_pieces(heads, self.q_rows // self.num_heads, parallel)
        kv_piece = head_pieces(kv_heads, self.head_dim, parallel)
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, (q_piece, kv_piece, kv_piece), bias=spec.qkv_bias, **kw)
        self.o_proj = RowParallelLinear(head_pieces(heads, self.head_dim, parallel), cfg.hidden_size, bias=spec.o_bias,
                                        state=parallel, **kw)
        self.q_norm = self.k_norm = None
        if spec.qk_norm == "head":
            self.q_norm, self.k_norm = _param(self.head_dim, **kw), _param(self.head_dim, **kw)
        elif spec.qk_norm == "full":  # over every head: whole on each rank
            self.q_norm, self.k_norm = _param(heads * self.head_dim, **kw), _param(kv_heads * self.head_dim, **kw)
        self.sinks = column_weight(head_pieces(heads, 1, parallel), **kw) if spec.sinks else None
        self.scale = spec.scale  # None: 1 / sqrt(head_dim)
        self.rope_layout = "interleaved" if cfg.rope.interleave else "half"
        self.use_rope = cfg.rope.enabled and (cfg.rope.layers is None or index in cfg.rope.layers)
        # AFMoE: a separate projection's sigmoid gates the attention output
        self.gate = None
        if spec.gate_proj:
            self.gate = ColumnParallelLinear(cfg.hidden_size, head_pieces(heads, self.head_dim, parallel), **kw)
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.use_ops(REFERENCE)

    def use_ops(self, ops: Ops) -> None:
        """The backend's norm, rotation and paged decode kernel for this layer; its fused q/k
        norms + RoPE where the layer is that simple (no output gate, no norm over every head, no
        clipping, half-split RoPE, the default norm)."""
        self.norm = ops.norm(self.norm_kind)
        self.rotate = ops.rotate(self.rope_layout)
        self.decode_kernel, self.prefill_kernel = ops.decode_attention, ops.prefill_attention
        simple = (self.q_rows == self.q_size and self.qk_norm in (None, "head") and self.clip_qkv is None
                  and self.rope_layout == "half" and self.norm_kind == "default")
        self.fused_heads = ops.attention_heads if simple else None

    def parts(self) -> AttentionParts:
        """This layer as a fused op takes it (ops/parts.py)."""
        per_head = self.qk_norm == "head"
        norm = (lambda w: NormParts(w, self.eps, self.norm_kind)) if self.q_norm is not None else (lambda w: None)
        return AttentionParts(
            layer=self, qkv=self.qkv_proj.parts(), o=self.o_proj.parts(), num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            scale=self.head_dim**-0.5 if self.scale is None else self.scale, rope=self.use_rope,
            q_norm=norm(self.q_norm) if per_head else None, k_norm=norm(self.k_norm) if per_head else None,
            rope_layout=self.rope_layout, norm_over_heads=self.qk_norm == "full",
            output_gate=self.q_rows != self.q_size, gate=None if self.gate is None else self.gate.parts(),
            clip_qkv=self.clip_qkv, window=self.window, sinks=None if self.sinks is None else self.sinks.weight,
            tp_size=self.parallel.tp_size)

    def _norm_all_heads(self, y: torch.Tensor, weight: torch.Tensor, heads: int) -> torch.Tensor:
        """RMSNorm over every head: under tensor parallelism the ranks' heads are gathered (each
        replicated head once), normed whole, and this rank's kept."""
        tp = self.parallel.tp_size
        if tp == 1:
            return self.norm(y, weight, self.eps)
        every = max(1, tp // heads)  # ranks holding the same replicated heads
        whole = self.norm(torch.cat(self.parallel.all_gather(y).chunk(tp, dim=-1)[::every], dim=-1), weight, self.eps)
        return whole.chunk(tp // every, dim=-1)[self.parallel.tp_rank // every]

    def allocate_cache(self, num_slots: int, dtype: torch.dtype, device: torch.device) -> None:
        shape = (num_slots, self.num_kv_heads, self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)

    def free_cache(self) -> None:
        self.k_cache = self.v_cache = None

    def weight_targets(self, prefix: str, module: str = "self_attn.") -> dict[str, torch.Tensor]:
        p = prefix + module
        targets: dict[str, torch.Tensor] = {}
        for i, name in enumerate("qkv"):
            targets[p + f"{name}_proj.weight"] = self.qkv_proj.part(i)
            if self.qkv_proj.bias is not None:
                targets[p + f"{name}_proj.bias"] = self.qkv_proj.bias_part(i)
        targets[p + "o_proj.weight"] = self.o_proj.part()
        if self.o_proj.bias is not None:
            targets[p + "o_proj.bias"] = self.o_proj.bias
        if self.q_norm is not None:
            targets[p + "q_norm.weight"] = self.q_norm
            targets[p + "k_norm.weight"] = self.k_norm
        if self.sinks is not None:
            targets[p + "sinks"] = self.sinks.part()
        if self.gate is not None:
            targets[p + "gate_proj.weight"] = self.gate.part()
        return targets

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        gate = None if self.gate is None else self.gate(x)
        heads = None
        if self.fused_heads is not None:  # the backend's fused kernel, where it takes this call
            q_norm, rope = self.q_norm, self.use_rope
            heads = self.fused_heads(qkv, self.num_heads, self.num_kv_heads, self.head_dim,
                                     None if q_norm is None else (q_norm, self.k_norm), self.eps,
                                     cos if rope else None, sin if rope else None)
        if heads is None:
            q, k, v, q_gate = self._heads(qkv, cos, sin)
            gate = gate if q_gate is None else q_gate
        else:
            q, k, v = heads
        if self.k_cache is None:
            raise RuntimeError("init_kv_cache(num_blocks, block_size) must be called before forward")
        o = paged_attention(q, k, v.contiguous(), self.k_cache, self.v_cache, meta, scale=self.scale, window=self.window,
                            sinks=None if self.sinks is None else self.sinks.weight, decode_kernel=self.decode_kernel,
                            prefill_kernel=self.prefill_kernel)
        o = o.reshape(x.shape[0], self.q_size)
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return self.o_proj(o)

    def _heads(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """(q [T, H, D], k, v [T, KVH, D]) from the fused projection, normed and rotated; with
        an output gate (Qwen3-Next), the gate's half of the q rows replaces `self.gate`'s."""
        t = qkv.shape[0]
        q, k, v = qkv.split([self.q_rows, self.kv_size, self.kv_size], dim=-1)
        gate = None
        if self.q_rows != self.q_size:
            q, gate = q.reshape(t, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
            gate = gate.reshape(t, self.q_size)
        if self.qk_norm == "full":  # OLMoE, MiniMax-M2: over all heads, before clipping
            q, k = self._norm_all_heads(q, self.q_norm, self.total_heads), self._norm_all_heads(k, self.k_norm,
                                                                                                  self.total_kv_heads)
        if self.clip_qkv is not None:
            q, k, v = (y.clamp(-self.clip_qkv, self.clip_qkv) for y in (q, k, v))
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head":  # Qwen3: per head
            q, k = self.norm(q, self.q_norm, self.eps), self.norm(k, self.k_norm, self.eps)
        if self.use_rope:
            q, k = self.rotate(q, cos, sin), self.rotate(k, cos, sin)
        return q, k, v, gate


class DenseMlp(Mlp):
    """A dense layer's SwiGLU MLP (gate_up: gate then up rows), or Nemotron-H's non-gated relu^2 one (up rows)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                 parallel: ParallelState = SINGLE) -> None:
        super().__init__(cfg.hidden_size, cfg.intermediate_size, gated=cfg.experts.gated, parallel=parallel,
                         dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, capture: torch.Tensor | None = None, weights=None,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward(at_rows(x, rows))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, dtype: torch.dtype, device: torch.device,
                 parallel: ParallelState = SINGLE) -> None:
        super().__init__()
        self.index = index
        self.eps = cfg.norm.eps
        self.norm_kind = norm_kind(cfg.norm)
        self.residual_multiplier = cfg.scales.residual  # Granite: each branch's output scaled
        self.is_moe = index in cfg.moe_layers
        # the norms before each branch (none in FlexOlmo's OLMo-2 layout)
        self.input_norm = _param(cfg.hidden_size, dtype=dtype, device=device) if cfg.norm.pre else None
        self.post_attention_norm = _param(cfg.hidden_size, dtype=dtype, device=device) if cfg.norm.pre else None
        # AFMoE's sandwich, FlexOlmo's output norms: each branch's output normalised before the residual add
        self.attn_out_norm = self.mlp_out_norm = None
        if cfg.norm.sandwich:
            self.attn_out_norm = _param(cfg.hidden_size, dtype=dtype, device=device)
            self.mlp_out_norm = _param(cfg.hidden_size, dtype=dtype, device=device)
        window = cfg.attention.window(index)
        self.linear_attn = None
        if index in cfg.linear_attention_layers:
            self.linear_attn = LINEAR_LAYERS[cfg.linear.kind](cfg, dtype, device, parallel)
        if self.linear_attn is not None:
            self.attn = None
        elif cfg.is_mla:
            self.attn = MlaAttention(cfg, dtype, device, index, parallel)
        else:
            self.attn = Attention(cfg, dtype, device, window, index, parallel)
        self.mlp = (SparseMoeBlock if self.is_moe else DenseMlp)(cfg, dtype, device, parallel)
        self.use_ops(REFERENCE)

    def use_ops(self, ops: Ops) -> None:
        """The backend's norm for this layer, and its fused decode step where the backend has one
        and it takes this layer's parts (`fused`; else why not: `fused_declined`)."""
        self.norm = ops.norm(self.norm_kind)
        self.fused, self.fused_declined = None, None
        if ops.fuse_decoder_layer is not None:
            try:
                self.fused = ops.fuse_decoder_layer(self.parts(), ops.linear)
            except Declined as why:
                self.fused_declined = str(why)

    def parts(self) -> DecoderParts:
        """This layer as a fused op takes it (ops/parts.py)."""
        def norm(weight):
            return None if weight is None else NormParts(weight, self.eps, self.norm_kind)

        mixer = self.linear_attn or self.attn
        mlp = self.mlp
        return DecoderParts(
            mixer=mixer.parts() if isinstance(mixer, Attention) else type(mixer).__name__,
            mlp=mlp.parts() if isinstance(mlp, (SparseMoeBlock, Mlp)) else type(mlp).__name__,
            input_norm=norm(self.input_norm), post_attention_norm=norm(self.post_attention_norm),
            attn_out_norm=norm(self.attn_out_norm), mlp_out_norm=norm(self.mlp_out_norm),
            residual_multiplier=self.residual_multiplier)

    def forward(self, x, cos, sin, meta, capture, states: LinearStateBatch | None = None, weights=None,
                rows: torch.Tensor | None = None):
        """The layer's output at `rows` of x (None: all rows): the mixer and the routing run for
        every row (their K/V, states and routed experts are the step's), the MLP for `rows` only."""
        h = self._pre_norm(x, self.input_norm)
        h = self.attn(h, cos, sin, meta) if self.linear_attn is None else self.linear_attn(h, states)
        x = x + self._branch(h, self.attn_out_norm)
        h = self.mlp(self._pre_norm(x, self.post_attention_norm), capture, weights, rows)
        return at_rows(x, rows) + self._branch(h, self.mlp_out_norm)

    def _pre_norm(self, x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        return x if weight is None else self.norm(x, weight, self.eps)

    def _branch(self, h: torch.Tensor, out_norm: torch.Tensor | None) -> torch.Tensor:
        """A branch's output as its residual add takes it (sandwich norm, residual multiplier)."""
        if out_norm is not None:
            h = self.norm(h, out_norm, self.eps)
        return h if self.residual_multiplier == 1.0 else h * self.residual_multiplier


class MixerBlock(nn.Module):
    """A Nemotron-H layer: one mixer (Mamba-2, attention, MoE or MLP) behind one norm."""

    def __init__(self, cfg: ModelConfig, index: int, dtype: torch.dtype, device: torch.device,
                 parallel: ParallelState = SINGLE) -> None:
        super().__init__()
        self.index, self.kind, self.eps = index, cfg.layer_kinds[index], cfg.norm.eps
        self.is_moe = self.kind == "moe"
        self.norm = _param(cfg.hidden_size, dtype=dtype, device=device)
        self.norm_kind = norm_kind(cfg.norm)
        self.linear_attn = Mamba2(cfg, dtype, device, parallel) if self.kind == "mamba" else None
        self.attn = Attention(cfg, dtype, device, parallel=parallel) if self.kind == "attention" else None
        self.mlp = {"moe": SparseMoeBlock, "mlp": DenseMlp}.get(self.kind, lambda *a: None)(cfg, dtype, device, parallel)
        self.fused = self.fused_declined = None  # no fused step for a one-mixer layer
        self.use_ops(REFERENCE)

    def use_ops(self, ops: Ops) -> None:
        self.norm_fn = ops.norm(self.norm_kind)

    def forward(self, x, cos, sin, meta, capture, states: LinearStateBatch | None = None, weights=None,
                rows: torch.Tensor | None = None):
        """The block's output at `rows` of x (None: all rows); a mixer runs for every row."""
        h = self.norm_fn(x, self.norm, self.eps)
        if self.attn is not None:
            h = self.attn(h, cos, sin, meta)
        elif self.linear_attn is not None:
            h = self.linear_attn(h, states)
        else:
            return at_rows(x, rows) + self.mlp(h, capture, weights, rows)
        return at_rows(x + h, rows)


def batch_invariance_gaps(cfg: ModelConfig) -> list[str]:
    """The layers of `cfg` whose numbers the batch-invariant ops (ops/invariant.py) do not yet
    make independent of the step: recurrent scans (chunked for prompts, stepped for decodes), DSA's
    indexer."""
    gaps = []
    if cfg.is_hybrid:
        gaps.append("linear-attention layers")
    if cfg.attention.sparse is not None:
        gaps.append("sparse-attention indexer")
    return gaps


class MoeForCausalLM(nn.Module):
    """A paged-KV MoE decoder. Call `init_kv_cache` once, then `forward(ForwardBatch)`."""

    def __init__(self, cfg: ModelConfig, *, dtype: torch.dtype, device: torch.device | str = "cpu",
                 parallel: ParallelState = SINGLE, ops: Ops | None = None, batch_invariant: bool = False) -> None:
        super().__init__()
        device = torch.device(device)
        self.config = cfg
        # the backend's batch-invariant kernels (r3srv.ops.ops_for) whenever ops are chosen anew
        gaps = batch_invariance_gaps(cfg) if batch_invariant else []
        if gaps:
            raise ConfigError(f"--batch-invariant does not cover {cfg.name}'s {' or '.join(gaps)} yet "
                              "(docs/replay.md, \"Determinism\")")
        self.batch_invariant = batch_invariant
        self.family = family_named(cfg.model_type)
        self.dtype = dtype
        self.device = device
        self.parallel = parallel  # this rank's shard of every layer (the whole model at size 1)
        self.embed = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, state=parallel, dtype=dtype, device=device)
        layer_class = DecoderLayer if cfg.layer_kinds is None else MixerBlock
        self.layers = nn.ModuleList(layer_class(cfg, i, dtype, device, parallel) for i in range(cfg.num_layers))
        self.final_norm = _param(cfg.hidden_size, dtype=dtype, device=device)
        self.lm_head = ParallelLMHead(self.embed, cfg.tie_word_embeddings, dtype=dtype, device=device)
        if cfg.rope.yarn:
            inv_freq, self.rope_attention_factor = yarn_inv_freq(cfg.rotary_dim, cfg.rope.theta, cfg.rope.yarn)
        else:
            inv_freq, self.rope_attention_factor = rope_inv_freq(cfg.rotary_dim, cfg.rope.theta), 1.0
        self.inv_freq = inv_freq.to(device)
        self.block_size = 0
        self.num_blocks = 0
        self.num_state_slots = 0
        self.num_state_snapshots = 0
        self.select_ops(ops)
        if self.ops.torch_threads is not None:  # the work outside forwards (loading, sampling); forwards set their own
            torch.set_num_threads(self.ops.threads)

    def select_ops(self, ops: Ops | None = None) -> None:
        """Bind every layer to `ops` (None: the backend of this model's device and dtype under the
        current settings, r3srv.ops.ops_for): each op's kernel is chosen here, once, and each
        layer takes the ones it calls. Tests and benchmarks call it again to switch a backend."""
        self.ops = ops_for(self.device, self.dtype, batch_invariant=self.batch_invariant) if ops is None else ops
        for module in self.modules():
            use = getattr(module, "use_ops", None)
            if use is not None:
                use(self.ops)
        self.norm = self.ops.norm(norm_kind(self.config.norm))
        self.fused_layers = any(layer.fused is not None for layer in self.layers)
        declined = {i: layer.fused_declined for i, layer in enumerate(self.layers) if layer.fused_declined is not None}
        if declined:
            log.info("%s backend: no fused decode step for layers %s (%s)", self.ops.name, sorted(declined),
                     "; ".join(sorted(set(declined.values()))))

    # ---- KV cache -------------------------------------------------------------------------
    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        """This rank's share: its KV heads (MLA's latent is whole on every rank)."""
        whole = self.config.kv_cache_bytes_per_block(block_size, self.dtype)
        if self.config.is_mla or self.parallel.tp_size == 1:
            return whole
        kv_heads = self.config.num_kv_heads
        return whole * local_heads(kv_heads, self.parallel) // kv_heads

    def state_bytes_per_slot(self) -> int:
        """Bytes of one sequence's linear-attention states (0 for a model without such layers)."""
        return self.config.linear_state_bytes(self.dtype) if self.config.is_hybrid else 0

    def init_kv_cache(self, num_blocks: int, block_size: int, num_state_slots: int = 8, num_state_snapshots: int = 0) -> None:
        """Allocate paged K/V for every attention layer and, in a hybrid model, linear-attention
        states per linear layer: `num_state_slots` slots (one per running sequence), then
        `num_state_snapshots` snapshots (prefix caching), replacing any earlier cache."""
        if num_blocks <= 0 or block_size <= 0 or num_state_slots <= 0 or num_state_snapshots < 0:
            raise ValueError(f"num_blocks={num_blocks}, block_size={block_size} and num_state_slots="
                             f"{num_state_slots} must be positive, num_state_snapshots={num_state_snapshots} >= 0")
        self.block_size, self.num_blocks = block_size, num_blocks
        hybrid = self.config.is_hybrid
        self.num_state_slots, self.num_state_snapshots = (num_state_slots, num_state_snapshots) if hybrid else (0, 0)
        for layer in self.layers:
            if layer.linear_attn is not None:
                layer.linear_attn.allocate_states(num_state_slots + num_state_snapshots, self.dtype, self.device)
            elif layer.attn is not None:
                layer.attn.allocate_cache(num_blocks * block_size, self.dtype, self.device)

    def free_kv_cache(self) -> None:
        """Drop every layer's K/V and states (init_kv_cache allocates them again)."""
        for layer in self.layers:
            if layer.linear_attn is not None:
                layer.linear_attn.free_states()
            elif layer.attn is not None:
                layer.attn.free_cache()

    @property
    def has_kv_cache(self) -> bool:
        first = next(layer for layer in self.layers if layer.attn is not None or layer.linear_attn is not None)
        return first.attn.k_cache is not None if first.linear_attn is None else first.linear_attn.has_states

    def transposed_layouts(self) -> set[str]:
        """Weight names a checkpoint may also hold transposed in their last two dims (the family
        says which; the loader tells the layouts apart by shape)."""
        suffixes = self.family.transposed
        return {name for name in self.weight_targets() if name.endswith(suffixes)} if suffixes else set()

    def move_weights(self, device: torch.device | str) -> None:
        """Move every weight to `device` in place (layers.move_parameters: to the host from a
        GPU into pinned memory; views made later by weight_targets see the moved data)."""
        move_parameters(self, device)
        self.select_ops(self.ops)  # the same kernels, bound again to the weights where they now lie

    lora_context = None  # the adapter slots' shared step (r3srv.lora) once enable_lora ran

    def enable_lora(self, num_slots: int):
        """Adapter slots (`num_slots` adapters at once) on every projection an adapter may
        target, then the ops bound again: a fused op that does not compute them declines."""
        from r3srv.lora.sites import attach

        context = attach(self, num_slots)
        self.select_ops(self.ops)
        return context

    def check_lora(self, adapter, param: str) -> None:
        """InvalidRequestError naming `param` for an adapter target or shape this model lacks."""
        from r3srv.lora.sites import bind

        bind(self, adapter, param)

    def load_lora_slot(self, slot: int, adapter) -> None:
        from r3srv.lora.sites import load_slot

        load_slot(self, slot, adapter)

    def clear_lora_slot(self, slot: int) -> None:
        from r3srv.lora.sites import clear_slot

        clear_slot(self, slot)

    # ---- forward --------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """float32 logits [B, vocab] at batch.logits_indices; writes this step's K/V and routing rows."""
        if self.block_size == 0:
            raise RuntimeError("init_kv_cache(num_blocks, block_size) must be called before forward")
        if self.ops.torch_threads is not None:
            threads = self.ops.torch_threads(batch.input_ids.shape[0])
            if torch.get_num_threads() != threads:  # most steps keep the last step's count
                torch.set_num_threads(threads)
        return self._forward(batch)

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        if self.lora_context is not None:  # which adapter each token runs under, for every slot holder
            self.lora_context.batch = batch.lora
        meta = AttentionMetadata.build(batch, self.block_size, self.device)
        meta.indexer_capture = batch.indexer_capture
        if batch.mrope_positions is not None:  # a vision-language prompt's M-RoPE ids
            cos, sin = mrope_cos_sin(batch.mrope_positions.to(self.device), self.inv_freq, self.config.rope, self.dtype)
        else:
            cos, sin = rope_cos_sin(batch.positions.to(self.device), self.inv_freq, self.dtype,
                                    self.config.rope.linear_factor, self.rope_attention_factor)
        x = self.embed(batch.input_ids.to(self.device))
        if self.config.scales.embedding != 1.0:
            x = x * self.config.scales.embedding
        visual = None if batch.visual is None else batch.visual.to(self.device, x.dtype)
        if visual is not None:  # image embeddings stand in for the placeholder tokens
            x = x.index_copy(0, visual.rows, visual.embeds)
        capture = batch.routing_capture
        states = None
        if self.config.is_hybrid:
            states = LinearStateBatch.build(batch, self.device, self.ops.scan_pad_factor)
            entries = states.entries()  # a graph step's entries were checked before they were copied in
            if entries and (max(entries) >= self.num_state_slots + self.num_state_snapshots or min(entries) < 0):
                raise ValueError(f"state entries {entries} outside the {self.num_state_slots} slots and "
                                 f"{self.num_state_snapshots} snapshots allocated")
        layer_captures = None if capture is None else capture.unbind(1)  # every layer's [T, top_k] view in one op
        layer_weights = None if batch.routing_weights is None else batch.routing_weights.unbind(1)
        fused = None  # the backend's fused decode step, where this step allows it (ops/cpu_decode.py)
        if states is None and visual is None and self.fused_layers:
            fused = self.ops.plan_fused_step(x, meta, cos, sin, None if layer_captures is None else layer_captures[0],
                                             self.config.num_experts, batch.routing_weights)
        logit_rows = batch.logits_indices.to(self.device)
        last = self.last_layer_rows(batch, visual, logit_rows)
        for layer in self.layers:
            layer_capture = layer_captures[layer.index] if layer_captures is not None and layer.is_moe else None
            rows = last if layer.index == len(self.layers) - 1 else None
            out = None
            if fused is not None and layer.fused is not None and rows is None:
                out = layer.fused(x, cos, sin, meta, layer_capture, fused)
            if out is None:
                weights = layer_weights[layer.index] if layer_weights is not None and layer.is_moe else None
                out = layer(x, cos, sin, meta, layer_capture, states, weights, rows)
            x = out
            if visual is not None and layer.index < len(visual.deepstack):  # Qwen3-VL's deepstack
                x = x.index_add(0, visual.rows, visual.deepstack[layer.index])
        x = self.norm(x if last is not None else x.index_select(0, logit_rows), self.final_norm, self.config.norm.eps)
        logits = self.lm_head(x).float()
        scaling = self.config.scales.logits
        return logits if scaling == 1.0 else logits / scaling

    def last_layer_rows(self, batch: ForwardBatch, visual, logit_rows: torch.Tensor) -> torch.Tensor | None:
        """The rows the last layer's MLP runs for: only the logits' rows where the step has
        others (a prompt's tokens before its last feed only the K/V and routing of the layers,
        which every row still gets); None (every row) where the step is all logits rows, or an
        adapter's per-token slots or an image's deepstack rows index the last layer's input."""
        if logit_rows.shape[0] >= batch.input_ids.shape[0] or batch.lora is not None:
            return None
        if visual is not None and len(visual.deepstack) >= len(self.layers):
            return None
        return logit_rows

    # ---- checkpoint names -----------------------------------------------------------------
    def weight_targets(self) -> dict[str, torch.Tensor]:
        """Hugging Face tensor name -> the view of our (stacked) parameter it fills: the family
        module's names (models/families/), released per-expert ones and transformers 5's fused ones."""
        return self.family.weight_targets(self)
