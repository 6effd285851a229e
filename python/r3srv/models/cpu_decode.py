"""A decoder layer's decode step on the CPU as straight calls into the Rust core.

On the CPU a decode step of the common MoE layer (pre-norm attention with per-head q/k norms
and RoPE, a softmax router, SiLU experts: Qwen3-MoE and its like) spends about as long in the
Python around its kernels (module dispatch, each wrapper re-checking tensors it checked a
moment before) as in the smaller kernels themselves. `FastDecodeLayer` checks once that every
part of a layer is one the Rust kernels take as they are; `DecodeStep` checks once per step
what the step and the settings allow; then each layer runs the kernels its modules would run,
with the same arguments, in the same order: the same bits (tests/test_cpu_decode.py compares
tokens, logits and routed experts with the module path). Anything else keeps the modules.
float32 or bfloat16 layers (weights, activations and KV cache of one dtype; a bfloat16 layer's
router may be float32, as the modules then cast its input): the kernels take both.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from r3srv import settings
from r3srv.kernels import expert_pairs_cpu, linear_cpu, paged_decode_cpu, qk_rope_cpu, rms_norm_cpu, router_cpu
from r3srv.kernels.router import _resolved
from r3srv.models.layers import rms_norm
from r3srv.models.moe import SparseMoeBlock, grouped_experts

F32 = torch.float32
# the kernels' dtype argument, and the norm and q/k kernels, by the layer's dtype
_CODES = linear_cpu.RUST_DTYPES
_NORMS = rms_norm_cpu._KERNELS
_QK_NORM_ROPE = qk_rope_cpu._KERNELS


@dataclass(frozen=True)
class DecodeStep:
    """What one decode step's layers share: its block tables, context lengths and rows in the
    decode kernel's int64 layout, the row count, the kernels' threads, the cache's page."""

    tables: torch.Tensor
    lens: torch.Tensor
    rows: torch.Tensor
    num_rows: int
    threads: int
    block_size: int

    @property
    def table_args(self) -> tuple[int, int, int]:
        return (self.tables.data_ptr(), *self.tables.shape)

    @staticmethod
    def plan(x: torch.Tensor, meta, cos: torch.Tensor, sin: torch.Tensor, capture: torch.Tensor | None,
             num_experts: int) -> "DecodeStep | None":
        """The step's shared arguments, or None where the fast path does not apply: turned off,
        not a decode-only float32 or bfloat16 CPU step, more rows than the Rust linear takes, a
        kernel turned off in the settings, or a capture view (any layer's: they share one
        layout) the router kernel cannot write."""
        rows = x.shape[0]
        if not x.is_cpu or x.dtype not in _CODES or meta.prefills or not meta.decode_seqs or meta.graph:
            return None
        if not 0 < rows <= linear_cpu.MAX_ROWS or len(meta.decode_seqs) != rows:
            return None
        current = settings.current()
        switches = (current.fast_cpu_decode, current.rust_linear, current.rust_rms_norm, current.rust_rope,
                    current.rust_decode, current.cpu_expert_kernel, current.rust_router)
        if not all(switches) or _resolved(None) != "auto":
            return None
        if not _kernels_built():
            return None
        ready = qk_rope_cpu._kernel_ready
        if not (ready(cos, x.dtype) and ready(sin, x.dtype) and cos.dim() == 2 and cos.shape[0] == rows and sin.shape == cos.shape):
            return None
        if capture is not None and not router_cpu._capture_fits(capture, rows, num_experts, capture.shape[-1]):
            return None
        tables, lens, seq_rows, _ = meta.decode_kernel_args()
        index = paged_decode_cpu._index
        return DecodeStep(index(tables), index(lens), index(seq_rows), rows, current.cpu_threads, meta.block_size)


@functools.cache
def _kernels_built() -> bool:
    kernels = (linear_cpu, rms_norm_cpu, qk_rope_cpu, paged_decode_cpu, expert_pairs_cpu, router_cpu)
    by_dtype = list(_NORMS.values()) + list(_QK_NORM_ROPE.values())
    return all(kernel.BUILT for kernel in kernels) and all(k is not None for k in by_dtype)


class FastDecodeLayer:
    """One eligible DecoderLayer's decode step in kernel calls (see the module docstring)."""

    def __init__(self, layer) -> None:
        # the layer's parts read once (module attribute lookups cost microseconds each); the
        # tensors are the parameters themselves, so in-place weight updates are seen
        attn, moe = layer.attn, layer.mlp
        self.layer, self.attn, self.eps = layer, attn, layer.eps
        self.input_norm, self.post_norm = layer.input_norm, layer.post_attention_norm
        self.qkv_w, self.o_w = attn.qkv_proj.weight, attn.o_proj.weight
        self.q_norm, self.k_norm = attn.q_norm, attn.k_norm
        self.heads, self.kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.scale = float(attn.head_dim**-0.5 if attn.scale is None else attn.scale)
        self.use_rope, self.qk_eps = attn.use_rope, attn.eps
        self.gate, self.w13, self.w2 = moe.gate, moe.experts.w13, moe.experts.w2
        self.top_k, self.scoring, self.scaling = moe.top_k, moe.scoring, moe.scaling
        self.renormalize = bool(moe.renormalize)
        # (name, alpha, limit), as the expert pass hands them to the kernel
        self.activation = expert_pairs_cpu._activation(moe.expert_pass.keywords["act"])

    @staticmethod
    def eligible(layer) -> bool:
        """Whether every part of `layer` is one the kernels below take unchanged: a pre-norm
        attention + MoE layer on one device, float32 or bfloat16 (one dtype; the router's gate
        may be float32), per-head q/k norms or none, no bias, gate, sinks, window or shared
        expert, a router without correction bias or groups, experts of one of the expert
        kernel's activations without biases."""
        from r3srv.models.model import Attention, DecoderLayer  # model.py imports this module

        if type(layer) is not DecoderLayer or layer.linear_attn is not None or type(layer.attn) is not Attention:
            return False
        if not layer.is_moe or type(layer.mlp) is not SparseMoeBlock or layer.norm is not rms_norm:
            return False
        if layer.input_norm is None or layer.post_attention_norm is None or layer.attn_out_norm is not None:
            return False
        if layer.mlp_out_norm is not None or layer.residual_multiplier != 1.0:
            return False
        attn, moe = layer.attn, layer.mlp
        if not attn.fused_heads or attn.gate is not None or attn.sinks is not None or attn.window is not None:
            return False
        if attn.qkv_proj.bias is not None or attn.o_proj.bias is not None or attn.parallel.tp_size != 1:
            return False
        if moe.shared is not None or moe.gate_bias is not None or moe.correction_bias is not None or moe.num_groups != 1:
            return False
        experts = moe.experts
        if experts.state.ep_size != 1 or experts.reduces or experts.b13 is not None or experts.b2 is not None:
            return False
        run = moe.expert_pass
        if not (isinstance(run, functools.partial) and run.func is grouped_experts and set(run.keywords) == {"act"}):
            return False
        if expert_pairs_cpu._activation(run.keywords["act"]) is None:
            return False
        tensors = [layer.input_norm, layer.post_attention_norm, attn.qkv_proj.weight, attn.o_proj.weight,
                   experts.w13, experts.w2] + ([] if attn.q_norm is None else [attn.q_norm, attn.k_norm])
        dtype = experts.w13.dtype
        if dtype not in _CODES or moe.gate.dtype not in (dtype, F32):
            return False
        return all(t.dtype is dtype for t in tensors) and all(t.is_cpu and t.is_contiguous() for t in tensors + [moe.gate])

    def __call__(self, x: torch.Tensor, cos, sin, meta, capture, step: DecodeStep) -> torch.Tensor:
        rows, hidden, threads = step.num_rows, x.shape[1], step.threads
        dtype, linear = x.dtype, linear_cpu._linear_cpu
        code, norm = _CODES[dtype], _NORMS[dtype]
        heads, kv_heads, head_dim = self.heads, self.kv_heads, self.head_dim
        rotary = cos.shape[-1] if self.use_rope else 0
        k_cache, v_cache = self.attn.k_cache, self.attn.v_cache
        # what the wrappers would decline (odd or too wide a rotary part; activations or a cache
        # of another dtype than the layer's, or no cache yet): the modules, which take their
        # other paths or raise
        if rotary % 2 or rotary > head_dim or k_cache is None or (k_cache.dtype, v_cache.dtype) != (dtype, dtype) \
                or self.qkv_w.dtype is not dtype:
            return self.layer(x, cos, sin, meta, capture)

        # attention: norm, q/k/v projection, q/k norms + RoPE, cache write, paged decode, output projection
        h = torch.empty_like(x)
        norm(x.data_ptr(), self.input_norm.data_ptr(), h.data_ptr(), rows, hidden, self.eps)
        qkv_w = self.qkv_w
        qkv = x.new_empty(rows, qkv_w.shape[0])
        linear((h.data_ptr(), qkv_w.data_ptr(), 0, qkv.data_ptr()), (rows, qkv_w.shape[0], hidden), code, threads)
        q = x.new_empty(rows, heads, head_dim)
        k = x.new_empty(rows, kv_heads, head_dim)
        v = x.new_empty(rows, kv_heads, head_dim)
        normed = self.q_norm is not None
        addresses = (qkv.data_ptr(), self.q_norm.data_ptr() if normed else 0, self.k_norm.data_ptr() if normed else 0,
                     cos.data_ptr() if rotary else 0, sin.data_ptr() if rotary else 0, q.data_ptr(), k.data_ptr(),
                     v.data_ptr())
        _QK_NORM_ROPE[dtype](addresses, (rows, heads, kv_heads, head_dim, rotary), self.qk_eps)
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
        o = x.new_empty(rows, heads, head_dim)
        head_major = paged_decode_cpu._head_major  # the wrapper's: pointers, shapes and the real strides
        paged_decode_cpu._paged_decode_attention(
            code, head_major("q", q), head_major("k_cache", k_cache), head_major("v_cache", v_cache), step.table_args,
            step.lens.data_ptr(), step.rows.data_ptr(), (o.data_ptr(), rows, heads, head_dim), step.block_size,
            self.scale, None, None, threads)
        o_w = self.o_w
        attended = torch.empty_like(x)
        linear((o.data_ptr(), o_w.data_ptr(), 0, attended.data_ptr()), (rows, hidden, o_w.shape[1]), code, threads)
        x = x + attended

        # MoE: norm, router (a float32 gate takes the normed rows cast, as the module casts them), expert pass
        h = torch.empty_like(x)
        norm(x.data_ptr(), self.post_norm.data_ptr(), h.data_ptr(), rows, hidden, self.eps)
        gate = self.gate
        experts = gate.shape[0]
        routed = h if gate.dtype is dtype else h.to(gate.dtype)
        gate_code = _CODES[gate.dtype]
        logits = routed.new_empty(rows, experts)
        linear((routed.data_ptr(), gate.data_ptr(), 0, logits.data_ptr()), (rows, experts, hidden), gate_code, threads)
        top_k = self.top_k
        weights = torch.empty(rows, top_k, dtype=F32)
        ids = torch.empty(rows, top_k, dtype=torch.int32)
        target = None if capture is None else (capture.data_ptr(), capture.stride(0), capture.element_size())
        router_cpu._route_experts(logits.data_ptr(), gate_code, (rows, experts, top_k), self.scoring, self.renormalize,
                                  self.scaling, weights.data_ptr(), ids.data_ptr(), target)
        w13, w2 = self.w13, self.w2
        num_experts, _, inter = w2.shape
        mixed = torch.empty_like(x)
        name, alpha, limit = self.activation
        addresses = (h.data_ptr(), w13.data_ptr(), w2.data_ptr(), 0, 0, 0, ids.data_ptr(), weights.data_ptr(),
                     mixed.data_ptr())
        expert_pairs_cpu._expert_pairs_cpu(addresses, (rows, rows * top_k, num_experts, hidden, inter), code, name,
                                           alpha, limit, threads)
        return x + mixed


__all__ = ["DecodeStep", "FastDecodeLayer"]
