"""The MoE decoder shared by every family (models/config.py's ARCHITECTURE_FAMILIES: Qwen2/3-MoE,
Qwen3-Next and Qwen3.5, Mixtral, OLMoE, GLM-4.5, 4.7-Flash and 5, MiniMax-M2, DeepSeek-V2/V3/V3.2,
gpt-oss, ERNIE-4.5, dots.llm1, Nemotron-H, Kimi-Linear, Granite-4.0-H and 3.x MoE, AFMoE, LFM2-MoE, Qwen3-VL-MoE).

One class with a few config switches rather than a class per family: the families differ
only in q/k norm width, qkv bias/clipping, rotary layout, sliding windows and sinks, the
router (scoring, bias, groups, renormalisation, scaling), the experts' activation and
biases, the shared expert, the checkpoint names (see `weight_targets`) and the token mixer:
multi-head latent attention for DeepSeek and GLM-4.7-Flash/5 (models/mla.py, sparse with
models/dsa.py), Gated DeltaNet, Kimi Delta Attention or Mamba-2 layers in the hybrids
(models/gated_deltanet.py, models/kda.py, models/mamba2.py). Nemotron-H's
layers are one mixer each (MixerBlock: Mamba-2, models/mamba2.py, attention, MoE or MLP).
"""

from __future__ import annotations

import os
import re

import torch
from torch import nn

from r3srv.errors import ConfigError
from r3srv.models.attention import AttentionMetadata, paged_attention
from r3srv.models.batch import ForwardBatch
from r3srv.models.config import ModelConfig
from r3srv.models.gated_deltanet import GatedDeltaNet
from r3srv.models.kda import KimiDeltaAttention
from r3srv.models.mamba2 import Mamba2
from r3srv.models.recurrent import LinearStateBatch
from r3srv.models.short_conv import ShortConv
from r3srv.models.layers import apply_rope, apply_rope_interleaved, rms_norm_for, rope_cos_sin, rope_inv_freq
from r3srv.models.layers import empty_param as _param
from r3srv.models.layers import yarn_inv_freq
from r3srv.models.mla import MlaAttention
from r3srv.models.moe import Mlp, SparseMoeBlock
from r3srv.models.parallel import (SINGLE, ColumnParallelLinear, ParallelLMHead, ParallelState, RowParallelLinear,
                                   VocabParallelEmbedding, column_weight, head_pieces, local_heads, transposed)


def _cpu_threads() -> int:
    """Intra-op threads for CPU forwards (see MoeForCausalLM.forward)."""
    value = os.environ.get("R3SRV_CPU_THREADS", "1")
    try:
        threads = int(value)
    except ValueError:
        threads = 0
    if threads < 1:
        raise ConfigError(f"R3SRV_CPU_THREADS={value!r} must be a positive integer")
    return threads


class Attention(nn.Module):
    """Grouped-query attention over this rank's heads (all of them at size 1; KV heads are
    replicated where there are fewer than ranks)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, window: int | None = None,
                 index: int = 0, parallel: ParallelState = SINGLE) -> None:
        super().__init__()
        self.window = window  # a sliding-window layer: keys at most window - 1 positions back
        kw = dict(dtype=dtype, device=device)
        heads, kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_kv_heads, cfg.head_dim
        self.num_heads, self.num_kv_heads = local_heads(heads, parallel), local_heads(kv_heads, parallel)
        if cfg.qk_norm == "full" and parallel.tp_size > 1:
            raise NotImplementedError("a q/k norm over all heads (OLMoE) under tensor parallelism")
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.eps = cfg.rms_norm_eps
        self.norm = rms_norm_for(cfg)
        self.qk_norm = cfg.qk_norm
        self.clip_qkv = cfg.clip_qkv
        # Qwen3-Next / 3.5: q_proj yields [q, gate] per head; the gate scales the attention output
        self.q_rows = 2 * self.q_size if cfg.attention_output_gate else self.q_size
        # q, k and v stacked: one matmul per layer
        q_piece = head_pieces(heads, self.q_rows // self.num_heads, parallel)
        kv_piece = head_pieces(kv_heads, self.head_dim, parallel)
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, (q_piece, kv_piece, kv_piece), bias=cfg.qkv_bias, **kw)
        self.o_proj = RowParallelLinear(head_pieces(heads, self.head_dim, parallel), cfg.hidden_size, bias=cfg.o_bias,
                                        state=parallel, **kw)
        self.q_norm = self.k_norm = None
        if cfg.qk_norm == "head":
            self.q_norm, self.k_norm = _param(self.head_dim, **kw), _param(self.head_dim, **kw)
        elif cfg.qk_norm == "full":
            self.q_norm, self.k_norm = _param(self.q_size, **kw), _param(self.kv_size, **kw)
        self.sinks = column_weight(head_pieces(heads, 1, parallel), **kw) if cfg.attention_sinks else None
        self.scale = cfg.attention_scale  # None: 1 / sqrt(head_dim)
        self.rotate = apply_rope_interleaved if cfg.rope_interleave else apply_rope
        self.use_rope = cfg.use_rope and (cfg.rope_layers is None or index in cfg.rope_layers)
        # AFMoE: a separate projection's sigmoid gates the attention output
        self.gate = None
        if cfg.attention_gate_proj:
            self.gate = ColumnParallelLinear(cfg.hidden_size, head_pieces(heads, self.head_dim, parallel), **kw)
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

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
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_rows, self.kv_size, self.kv_size], dim=-1)
        gate = None if self.gate is None else self.gate(x)
        if self.q_rows != self.q_size:
            q, gate = q.reshape(t, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
            gate = gate.reshape(t, self.q_size)
        if self.qk_norm == "full":  # OLMoE: over all heads, before clipping
            q, k = self.norm(q, self.q_norm, self.eps), self.norm(k, self.k_norm, self.eps)
        if self.clip_qkv is not None:
            q, k, v = (y.clamp(-self.clip_qkv, self.clip_qkv) for y in (q, k, v))
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head":  # Qwen3: per head
            q, k = self.norm(q, self.q_norm, self.eps), self.norm(k, self.k_norm, self.eps)
        if self.use_rope:
            q, k = self.rotate(q, cos, sin), self.rotate(k, cos, sin)
        if self.k_cache is None:
            raise RuntimeError("init_kv_cache(num_blocks, block_size) must be called before forward")
        o = paged_attention(q, k, v.contiguous(), self.k_cache, self.v_cache, meta, scale=self.scale, window=self.window,
                            sinks=None if self.sinks is None else self.sinks.weight, decode_kernel=True)
        o = o.reshape(t, self.q_size)
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return self.o_proj(o)


class DenseMlp(Mlp):
    """A dense layer's SwiGLU MLP (gate_up: gate then up rows), or Nemotron-H's non-gated relu^2 one (up rows)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                 parallel: ParallelState = SINGLE) -> None:
        super().__init__(cfg.hidden_size, cfg.intermediate_size, gated=cfg.expert_activation != "relu2",
                         parallel=parallel, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, capture: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward(x)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, dtype: torch.dtype, device: torch.device,
                 parallel: ParallelState = SINGLE) -> None:
        super().__init__()
        self.index = index
        self.eps = cfg.rms_norm_eps
        self.norm = rms_norm_for(cfg)
        self.residual_multiplier = cfg.residual_multiplier  # Granite: each branch's output scaled
        self.is_moe = index in cfg.moe_layers
        # the norms before each branch (none in FlexOlmo's OLMo-2 layout)
        self.input_norm = _param(cfg.hidden_size, dtype=dtype, device=device) if cfg.pre_norms else None
        self.post_attention_norm = _param(cfg.hidden_size, dtype=dtype, device=device) if cfg.pre_norms else None
        # AFMoE's sandwich, FlexOlmo's output norms: each branch's output normalised before the residual add
        self.attn_out_norm = self.mlp_out_norm = None
        if cfg.sandwich_norms:
            self.attn_out_norm = _param(cfg.hidden_size, dtype=dtype, device=device)
            self.mlp_out_norm = _param(cfg.hidden_size, dtype=dtype, device=device)
        window = cfg.sliding_windows[index] if cfg.sliding_windows else None
        linear = {"kda": KimiDeltaAttention, "mamba2": Mamba2, "short_conv": ShortConv}.get(cfg.linear_attention_kind,
                                                                                           GatedDeltaNet)
        self.linear_attn = linear(cfg, dtype, device, parallel) if index in cfg.linear_attention_layers else None
        if self.linear_attn is not None:
            self.attn = None
        elif cfg.is_mla:
            self.attn = MlaAttention(cfg, dtype, device, index, parallel)
        else:
            self.attn = Attention(cfg, dtype, device, window, index, parallel)
        self.mlp = (SparseMoeBlock if self.is_moe else DenseMlp)(cfg, dtype, device, parallel)

    def forward(self, x, cos, sin, meta, capture, states: LinearStateBatch | None = None):
        h = self._pre_norm(x, self.input_norm)
        h = self.attn(h, cos, sin, meta) if self.linear_attn is None else self.linear_attn(h, states)
        x = x + self._branch(h, self.attn_out_norm)
        h = self.mlp(self._pre_norm(x, self.post_attention_norm), capture)
        return x + self._branch(h, self.mlp_out_norm)

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
        self.index, self.kind, self.eps = index, cfg.layer_kinds[index], cfg.rms_norm_eps
        self.is_moe = self.kind == "moe"
        self.norm = _param(cfg.hidden_size, dtype=dtype, device=device)
        self.norm_fn = rms_norm_for(cfg)
        self.linear_attn = Mamba2(cfg, dtype, device, parallel) if self.kind == "mamba" else None
        self.attn = Attention(cfg, dtype, device, parallel=parallel) if self.kind == "attention" else None
        self.mlp = {"moe": SparseMoeBlock, "mlp": DenseMlp}.get(self.kind, lambda *a: None)(cfg, dtype, device, parallel)

    def forward(self, x, cos, sin, meta, capture, states: LinearStateBatch | None = None):
        h = self.norm_fn(x, self.norm, self.eps)
        if self.attn is not None:
            return x + self.attn(h, cos, sin, meta)
        if self.linear_attn is not None:
            return x + self.linear_attn(h, states)
        return x + self.mlp(h, capture)

    def weight_targets(self, prefix: str) -> dict[str, torch.Tensor]:
        targets = {prefix + "norm.weight": self.norm}
        if self.attn is not None:
            return targets | self.attn.weight_targets(prefix, module="mixer.")
        if self.linear_attn is not None:
            return targets | self.linear_attn.weight_targets(prefix)
        p = prefix + "mixer."
        if isinstance(self.mlp, DenseMlp):
            return targets | {p + "up_proj.weight": self.mlp.gate_up.part(), p + "down_proj.weight": self.mlp.down.part()}
        mlp, experts = self.mlp, self.mlp.experts
        targets |= {p + "gate.weight": mlp.gate, p + "gate.e_score_correction_bias": mlp.correction_bias,
                    p + "experts.up_proj": experts.w13_part(), p + "experts.down_proj": experts.w2_part()}  # transformers 5's fused names
        for e in experts.local_ids:
            targets[p + f"experts.{e}.up_proj.weight"] = experts.w13_part(e)
            targets[p + f"experts.{e}.down_proj.weight"] = experts.w2_part(e)
        if mlp.shared is not None:
            targets[p + "shared_experts.up_proj.weight"] = mlp.shared.gate_up.part()
            targets[p + "shared_experts.down_proj.weight"] = mlp.shared.down.part()
        return targets


class MoeForCausalLM(nn.Module):
    """A paged-KV MoE decoder. Call `init_kv_cache` once, then `forward(ForwardBatch)`."""

    def __init__(self, cfg: ModelConfig, *, dtype: torch.dtype, device: torch.device | str = "cpu",
                 parallel: ParallelState = SINGLE) -> None:
        super().__init__()
        device = torch.device(device)
        self.config = cfg
        self.dtype = dtype
        self.device = device
        self.parallel = parallel  # this rank's shard of every layer (the whole model at size 1)
        self.embed = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, state=parallel, dtype=dtype, device=device)
        layer_class = DecoderLayer if cfg.layer_kinds is None else MixerBlock
        self.layers = nn.ModuleList(layer_class(cfg, i, dtype, device, parallel) for i in range(cfg.num_layers))
        self.final_norm = _param(cfg.hidden_size, dtype=dtype, device=device)
        self.lm_head = ParallelLMHead(self.embed, cfg.tie_word_embeddings, dtype=dtype, device=device)
        if cfg.rope_yarn:
            inv_freq, self.rope_attention_factor = yarn_inv_freq(cfg.rotary_dim, cfg.rope_theta, cfg.rope_yarn)
        else:
            inv_freq, self.rope_attention_factor = rope_inv_freq(cfg.rotary_dim, cfg.rope_theta), 1.0
        self.inv_freq = inv_freq.to(device)
        self.norm = rms_norm_for(cfg)
        self.block_size = 0
        self.num_blocks = 0
        self.num_state_slots = 0
        self.num_state_snapshots = 0
        self.cpu_threads = _cpu_threads() if device.type == "cpu" else 0

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
        """Weight names a checkpoint may also hold transposed in their last two dims: Qwen3-VL's
        released fused experts are [E, H, 2I] and [E, I, H], while transformers 5 saves them as
        it holds them ([E, 2I, H], [E, H, I]); the loader tells them apart by shape."""
        if self.config.model_type != "qwen3_vl_moe":
            return set()
        return {name for name in self.weight_targets() if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))}

    def move_weights(self, device: torch.device | str) -> None:
        """Move every weight to `device` in place (the module keeps its parameters, views
        made later by weight_targets see the moved data). To the host, on a CUDA model,
        into pinned memory so the way back is one fast copy."""
        device = torch.device(device)
        pin = device.type == "cpu" and self.device.type == "cuda"
        for param in self.parameters():  # tied embeddings: one parameter, moved once
            data = param.data.to(device)
            param.data = data.pin_memory() if pin else data

    # ---- forward --------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """float32 logits [B, vocab] at batch.logits_indices; writes this step's K/V and routing rows.

        On the CPU the step runs on `cpu_threads` intra-op threads ($R3SRV_CPU_THREADS,
        default 1). On a busy 2-core machine every parallel op waits for a descheduled
        sibling thread: measured on the built-in model with load ~5, one thread decoded at
        ~100 tok/s against 5 tok/s with two, and prefilled 2,000 tok/s against 250-350.
        """
        if self.block_size == 0:
            raise RuntimeError("init_kv_cache(num_blocks, block_size) must be called before forward")
        threads = torch.get_num_threads()
        if self.device.type != "cpu" or threads == self.cpu_threads:
            return self._forward(batch)
        torch.set_num_threads(self.cpu_threads)
        try:
            return self._forward(batch)
        finally:
            torch.set_num_threads(threads)

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        meta = AttentionMetadata.build(batch, self.block_size, self.device)
        positions = batch.positions.to(self.device)
        cos, sin = rope_cos_sin(
            positions, self.inv_freq, self.dtype, self.config.rope_scaling_factor, self.rope_attention_factor
        )
        x = self.embed(batch.input_ids.to(self.device))
        if self.config.embedding_multiplier != 1.0:
            x = x * self.config.embedding_multiplier
        capture = batch.routing_capture
        states = None
        if self.config.is_hybrid:
            states = LinearStateBatch.build(batch, self.device)
            entries = states.entries()
            if max(entries) >= self.num_state_slots + self.num_state_snapshots or min(entries) < 0:
                raise ValueError(f"state entries {entries} outside the {self.num_state_slots} slots and "
                                 f"{self.num_state_snapshots} snapshots allocated")
        for layer in self.layers:
            layer_capture = capture[:, layer.index] if capture is not None and layer.is_moe else None
            x = layer(x, cos, sin, meta, layer_capture, states)
        x = self.norm(x.index_select(0, batch.logits_indices.to(self.device)), self.final_norm, self.config.rms_norm_eps)
        logits = self.lm_head(x).float()
        return logits if self.config.logits_scaling == 1.0 else logits / self.config.logits_scaling

    # ---- checkpoint names -----------------------------------------------------------------
    def weight_targets(self) -> dict[str, torch.Tensor]:
        """Hugging Face tensor name -> the view of our (stacked) parameter it fills.

        Both the per-expert names of released checkpoints and the fused 3-D names that
        transformers 5 keeps in memory (`experts.gate_up_proj`, `experts.down_proj`) map here.
        """
        cfg = self.config
        family = cfg.model_type
        targets: dict[str, torch.Tensor] = {"model.embed_tokens.weight": self.embed.part(),
                                            "model.norm.weight": self.final_norm}
        if not cfg.tie_word_embeddings:
            targets["lm_head.weight"] = self.lm_head.part()
        if family == "nemotron_h":
            return _nemotron_h_targets(self, targets)
        for layer in self.layers:
            p = f"model.layers.{layer.index}."
            if layer.input_norm is not None:
                targets[p + "input_layernorm.weight"] = layer.input_norm
            if layer.attn_out_norm is None:
                targets[p + "post_attention_layernorm.weight"] = layer.post_attention_norm
            else:  # AFMoE's and FlexOlmo's post_attention_layernorm is the attention output's
                targets[p + "post_attention_layernorm.weight"] = layer.attn_out_norm
                if family == "afmoe":
                    targets[p + "pre_mlp_layernorm.weight"] = layer.post_attention_norm
                    targets[p + "post_mlp_layernorm.weight"] = layer.mlp_out_norm
                else:
                    targets[p + "post_feedforward_layernorm.weight"] = layer.mlp_out_norm
            targets.update((layer.linear_attn or layer.attn).weight_targets(p))
            mlp = layer.mlp
            if isinstance(mlp, DenseMlp):
                targets[p + "mlp.gate_proj.weight"] = mlp.gate_up.part(0)
                targets[p + "mlp.up_proj.weight"] = mlp.gate_up.part(1)
                targets[p + "mlp.down_proj.weight"] = mlp.down.part()
                if family == "kimi_linear":  # transformers writes Kimi-Linear's dense MLPs as block_sparse_moe
                    for name in ("gate_proj", "up_proj", "down_proj"):
                        targets[p + f"block_sparse_moe.{name}.weight"] = targets[p + f"mlp.{name}.weight"]
                continue
            if family == "gpt_oss":
                targets.update(_gpt_oss_moe_targets(p, mlp))
            elif family in ("granitemoehybrid", "granitemoe", "granitemoeshared", "granitemoe_swa"):
                targets.update(_granite_moe_targets(p, mlp))
            else:
                targets.update(_moe_targets(family, p, mlp))
        if family == "lfm2_moe":
            return {_lfm2_name(name): target for name, target in targets.items()}
        if family in ("qwen3_5_moe", "qwen3_vl_moe"):  # the multimodal checkpoint nests the language model
            targets |= {"model.language_model." + k.removeprefix("model."): v
                        for k, v in targets.items() if k.startswith("model.")}
        return targets


# Where each family keeps what the standard names do not cover
_MIXTRAL_NAMES = ("mixtral", "minimax_m2", "kimi_linear")  # block_sparse_moe.experts.<e>.w1 / w3 / w2
# mlp.shared_experts, no gate
_SHARED_EXPERTS = ("glm4_moe", "glm4_moe_lite", "deepseek_v3", "deepseek_v2", "ernie4_5_moe", "dots1", "deepseek_v32",
                   "glm_moe_dsa", "kimi_linear", "afmoe")
_BIAS_NAMES = {  # e_score_correction_bias; transformers 5 in memory: mlp.e_score_correction_bias
    "glm4_moe": ("mlp.gate.e_score_correction_bias",),
    "glm4_moe_lite": ("mlp.gate.e_score_correction_bias",),
    "dots1": ("mlp.gate.e_score_correction_bias",),
    "deepseek_v3": ("mlp.gate.e_score_correction_bias",),
    "deepseek_v32": ("mlp.gate.e_score_correction_bias",),
    "glm_moe_dsa": ("mlp.gate.e_score_correction_bias",),
    "kimi_linear": ("block_sparse_moe.gate.e_score_correction_bias", "mlp.gate.e_score_correction_bias"),
    "afmoe": ("mlp.expert_bias",),
    "lfm2_moe": ("feed_forward.expert_bias",),
    "minimax_m2": ("block_sparse_moe.e_score_correction_bias", "mlp.e_score_correction_bias"),
    "ernie4_5_moe": ("mlp.moe_statics.e_score_correction_bias", "mlp.gate.moe_statics.e_score_correction_bias"),
}


# LFM2's names for the standard ones (its experts: w1 gate, w3 up, w2 down, as its dense MLPs)
_LFM2_NAMES = [(re.compile(pattern), replacement) for pattern, replacement in (
    (r"\.input_layernorm\.", ".operator_norm."), (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.self_attn\.o_proj\.", ".self_attn.out_proj."), (r"\.self_attn\.([qk])_norm\.", r".self_attn.\1_layernorm."),
    (r"\.mlp\.", ".feed_forward."), (r"\.gate_proj\.", ".w1."), (r"\.up_proj\.", ".w3."), (r"\.down_proj\.", ".w2."),
    (r"^model\.norm\.", "model.embedding_norm."),
)]


def _lfm2_name(name: str) -> str:
    for pattern, replacement in _LFM2_NAMES:
        name = pattern.sub(replacement, name)
    return name


def _moe_targets(family: str, p: str, mlp: SparseMoeBlock) -> dict[str, torch.Tensor]:
    """Released per-expert names and transformers 5's fused ones, for every family but gpt-oss."""
    mixtral_names = family in _MIXTRAL_NAMES
    moe_prefix = p + ("block_sparse_moe." if mixtral_names else "mlp.")
    gate_name, up_name, down_name = ("w1", "w3", "w2") if mixtral_names else ("gate_proj", "up_proj", "down_proj")
    targets = {moe_prefix + "gate.weight": mlp.gate}
    if family == "afmoe":  # its router holds the gate linear
        targets[moe_prefix + "router.gate.weight"] = mlp.gate
    if mlp.correction_bias is not None:
        for name in _BIAS_NAMES[family]:  # ERNIE stores it as [1, E]
            targets[p + name] = mlp.correction_bias.view(1, -1) if family == "ernie4_5_moe" else mlp.correction_bias
    experts = mlp.experts
    for e in experts.local_ids:  # logical ids: another rank's experts are not targets here
        ep = f"{moe_prefix}experts.{e}."
        targets[ep + f"{gate_name}.weight"] = experts.w13_part(e, 0)
        targets[ep + f"{up_name}.weight"] = experts.w13_part(e, 1)
        targets[ep + f"{down_name}.weight"] = experts.w2_part(e)
    # transformers 5 in-memory (fused) names, which use "mlp." for every family
    targets[p + "mlp.gate.weight"] = mlp.gate
    targets[p + "mlp.experts.gate_up_proj"] = experts.w13_part()
    targets[p + "mlp.experts.down_proj"] = experts.w2_part()
    if mlp.shared is not None:
        # Qwen2-MoE: one gated "shared_expert"; GLM-4.5 and others: gate-less "shared_experts"
        shared = p + ("mlp.shared_experts." if family in _SHARED_EXPERTS else "mlp.shared_expert.")
        targets[shared + "gate_proj.weight"] = mlp.shared.gate_up.part(0)
        targets[shared + "up_proj.weight"] = mlp.shared.gate_up.part(1)
        targets[shared + "down_proj.weight"] = mlp.shared.down.part()
        if mlp.shared_gate is not None:
            targets[p + "mlp.shared_expert_gate.weight"] = mlp.shared_gate
        if family == "kimi_linear":  # released under block_sparse_moe like its experts
            targets |= {k.replace(".mlp.", ".block_sparse_moe.", 1): v for k, v in targets.items() if k.startswith(shared)}
    return targets


def _granite_moe_targets(prefix: str, mlp: SparseMoeBlock) -> dict[str, torch.Tensor]:
    """Granite's fused experts (input_linear: gate then up rows; output_linear) and its shared MLP."""
    p = prefix + "block_sparse_moe."
    experts = mlp.experts
    targets = {p + "router.layer.weight": mlp.gate, p + "router.weight": mlp.gate,
               p + "input_linear.weight": experts.w13_part(), p + "output_linear.weight": experts.w2_part(),
               p + "experts.gate_up_proj": experts.w13_part(), p + "experts.down_proj": experts.w2_part()}
    if mlp.shared is not None:
        targets[prefix + "shared_mlp.input_linear.weight"] = mlp.shared.gate_up.part()
        targets[prefix + "shared_mlp.output_linear.weight"] = mlp.shared.down.part()
    return targets


def _nemotron_h_targets(model: MoeForCausalLM, targets: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Nemotron-H's names: embeddings and norm_f, one mixer per layer; released checkpoints
    spell "model." as "backbone."."""
    targets = {"lm_head.weight": targets["lm_head.weight"]} if "lm_head.weight" in targets else {}
    named = {"model.embeddings.weight": model.embed.part(), "model.norm_f.weight": model.final_norm}
    for layer in model.layers:
        named |= layer.weight_targets(f"model.layers.{layer.index}.")
    named = {k: v for k, v in named.items() if v is not None}
    return targets | named | {"backbone." + k.removeprefix("model."): v for k, v in named.items()}


def _gpt_oss_moe_targets(prefix: str, mlp: SparseMoeBlock) -> dict[str, torch.Tensor]:
    """gpt-oss keeps experts fused and transposed ([E, H, 2I] with gate/up columns interleaved,
    [E, I, H]): views of w13 (whose rows stay interleaved, see moe.clamped_swiglu) and w2."""
    p, experts = prefix + "mlp.", mlp.experts
    b13, b2 = experts.bias_parts()
    return {
        p + "router.weight": mlp.gate,
        p + "router.bias": mlp.gate_bias,
        p + "experts.gate_up_proj": transposed(experts.w13_part()),
        p + "experts.gate_up_proj_bias": b13,
        p + "experts.down_proj": transposed(experts.w2_part()),
        p + "experts.down_proj_bias": b2,
    }
