"""The CPU backend's fused op: a decoder layer's decode step as straight calls into the Rust core.

On the CPU a decode step of the common MoE layer (pre-norm attention with per-head q/k norms
and RoPE, a softmax router, SiLU experts: Qwen3-MoE and its like) spends about as long in the
Python around its kernels (module dispatch, each wrapper re-checking tensors it checked a
moment before) as in the smaller kernels themselves. The layer hands its parts
(ops/parts.py) to `fuse_decoder_layer` when the model is built: what they hold beyond what
this op computes makes it decline then, naming the parts. `DecodeStep.plan` checks once per
step what the step allows (decode only, at most the Rust linear's rows); then each layer runs
the kernels the CPU backend's ops run for its modules, with the same arguments, in the same
order, adapters included (a projection's adapter slots add their low-rank terms as the module's
do, through the same calls): the same bits (tests/test_fused_decode_cpu.py compares tokens,
logits and routed experts with the modules). float32 or bfloat16 layers (weights, activations and KV cache of one
dtype; a bfloat16 layer's router gate may be float32, its input cast as the modules cast it): the
kernels take both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from r3srv.kernels import expert_pairs_cpu, linear_cpu, paged_decode_cpu, qk_rope_cpu, rms_norm_cpu, router_cpu
from r3srv.ops.parts import AttentionParts, Declined, DecoderParts, MoeParts, unsupported

F32 = torch.float32
CODES = linear_cpu.RUST_DTYPES  # the kernels' dtype argument, by torch dtype
KERNELS = (linear_cpu, rms_norm_cpu, qk_rope_cpu, paged_decode_cpu, expert_pairs_cpu, router_cpu)


def _unpacked(weight: torch.Tensor, threads: int) -> None:
    """No packed copy (--no-packed-linear): the weight's rows read in place."""
    return None


def kernels_built() -> bool:
    return all(kernel.BUILT for kernel in KERNELS)


def kernels_built_for(dtype: torch.dtype) -> bool:
    """Whether this build has the norm and q/k kernels of `dtype` (the others take both)."""
    return (rms_norm_cpu.RMS_NORM_ENTRIES.get(dtype) is not None
            and qk_rope_cpu.QK_NORM_ROPE_ENTRIES.get(dtype) is not None)


@dataclass(frozen=True)
class DecodeStep:
    """What one decode step's layers share: its block tables, context lengths and rows in the
    decode kernel's int64 layout, the row count, the kernels' threads, the cache's page, and
    the new tokens' cache slots (int64)."""

    tables: torch.Tensor
    lens: torch.Tensor
    rows: torch.Tensor
    num_rows: int
    threads: int
    block_size: int
    slots: torch.Tensor

    @property
    def table_args(self) -> tuple[int, int, int]:
        return (self.tables.data_ptr(), *self.tables.shape)

    @staticmethod
    def plan(x: torch.Tensor, meta, cos: torch.Tensor, sin: torch.Tensor, capture: torch.Tensor | None,
             num_experts: int, threads: int, weights=None) -> "DecodeStep | None":
        """The step's shared arguments, or None where the fused layers do not apply: not a
        decode-only float32 or bfloat16 CPU step, a step capturing router weights (`weights`:
        the fused router writes the ids only), more rows than the Rust linear takes of packed
        weights (each layer declines more than it takes of its own: `FusedDecoderLayer`), cos/sin of
        another dtype, or a capture view (any layer's: they share one layout) the router kernel
        cannot write."""
        rows = x.shape[0]
        if (weights is not None or not x.is_cpu or x.dtype not in CODES or meta.prefills or not meta.decode_seqs
                or meta.graph):
            return None
        if not 0 < rows <= linear_cpu.PACKED_MAX_ROWS or len(meta.decode_seqs) != rows:
            return None
        ready = qk_rope_cpu.kernel_ready
        if not (ready(cos, x.dtype) and ready(sin, x.dtype) and cos.dim() == 2 and cos.shape[0] == rows and sin.shape == cos.shape):
            return None
        if capture is not None and not router_cpu.capture_fits(capture, rows, num_experts, capture.shape[-1]):
            return None
        tables, lens, seq_rows, _ = meta.decode_kernel_args()
        index = paged_decode_cpu.as_index
        return DecodeStep(index(tables), index(lens), index(seq_rows), rows, threads, meta.block_size,
                          index(meta.slot_mapping))


def fuse_decoder_layer(parts: DecoderParts, linear=torch.nn.functional.linear, pack: bool = False,
                       pack_linear: bool = False) -> "FusedDecoderLayer":
    """The fused decode step of the layer these parts describe; Declined (naming every part it
    does not compute) unless it is a pre-norm attention + MoE layer on one device, float32 or
    bfloat16 (one dtype; the router gate may be float32), per-head q/k norms or none, half-split
    RoPE or none, no bias, gate, sinks, window, clip or shared expert, a router without
    correction bias or groups, and experts of one of the expert kernel's activations without
    biases. Adapter slots (`lora` on q/k/v, o, the router gate and the experts: a model served
    with --enable-lora) are computed as the modules compute them; `linear` is the backend's
    linear op, which they hand the slots for the projections the Rust pass cannot read. `pack`: experts read
    from their packed copy (kernels/expert_pairs_cpu.py's packed_experts), as the backend's
    expert pass reads them; `pack_linear`: the projections' and the router gate's weights from
    theirs where the linear kernel reads one (kernels/linear_cpu.py's packed_weight), as the
    backend's linear op reads them."""
    problems = unsupported(parts, {"mixer", "mlp", "input_norm", "post_attention_norm"})
    for name in ("input_norm", "post_attention_norm"):
        norm = getattr(parts, name)
        if norm is None or norm.kind != "default":
            problems.append(f"{name}: {'none' if norm is None else norm.kind}")
    attn, moe = parts.mixer, parts.mlp
    if not isinstance(attn, AttentionParts):
        problems.append(f"mixer: {attn}")
    else:
        problems += unsupported(attn, {"layer", "qkv", "o", "num_heads", "num_kv_heads", "head_dim", "scale", "rope",
                                       "q_norm", "k_norm"}, "mixer.")
        for name in ("qkv", "o"):
            problems += unsupported(getattr(attn, name), {"weight", "lora"}, f"mixer.{name}.")
        if (attn.q_norm is None) != (attn.k_norm is None):
            problems.append("mixer: a q norm without a k norm")
        for norm in (attn.q_norm, attn.k_norm):
            if norm is not None and (norm.kind != "default" or norm.eps != attn.q_norm.eps):
                problems.append(f"mixer: q/k norms of kind {norm.kind}, eps {norm.eps}")
    if not isinstance(moe, MoeParts):
        problems.append(f"mlp: {type(moe).__name__ if not isinstance(moe, str) else moe}")
    else:
        problems += unsupported(moe, {"router", "experts"}, "mlp.")
        problems += unsupported(moe.router, {"gate", "top_k", "scoring", "renormalize", "scaling"}, "mlp.router.")
        problems += unsupported(moe.router.gate, {"weight", "lora"}, "mlp.router.gate.")
        problems += unsupported(moe.experts, {"w13", "w2", "activation", "lora"}, "mlp.experts.")
        if moe.experts.activation.name not in expert_pairs_cpu.ACTIVATIONS:
            problems.append(f"mlp.experts.activation: {moe.experts.activation.name}")
    if not problems:
        tensors = [parts.input_norm.weight, parts.post_attention_norm.weight, attn.qkv.weight, attn.o.weight,
                   moe.experts.w13, moe.experts.w2]
        tensors += [n.weight for n in (attn.q_norm, attn.k_norm) if n is not None]
        gate, dtype = moe.router.gate.weight, moe.experts.w13.dtype
        if not all(t.is_cpu and t.is_contiguous() for t in tensors + [gate]):
            problems.append("weights: not contiguous CPU tensors")
        if dtype not in CODES or any(t.dtype is not dtype for t in tensors) or gate.dtype not in (dtype, F32):
            problems.append("weights: not of one dtype, float32 or bfloat16 (the router gate may be float32)")
        elif not kernels_built_for(dtype):
            problems.append(f"weights: {dtype} (this build of the Rust core lacks its norm kernels)")
    if problems:
        raise Declined(", ".join(problems))
    return FusedDecoderLayer(parts, linear, pack, pack_linear)


class FusedDecoderLayer:
    """One layer's decode step in kernel calls (see the module docstring)."""

    def __init__(self, parts: DecoderParts, linear, pack: bool = False, pack_linear: bool = False) -> None:
        # the parts read once (attribute lookups cost microseconds each); the tensors are the
        # parameters themselves, so in-place weight updates are seen
        attn, moe = parts.mixer, parts.mlp
        self.attn_layer = attn.layer  # its cache is allocated (and reallocated) after the build
        self.dtype = parts.mlp.experts.w13.dtype
        self.norm_entry = rms_norm_cpu.RMS_NORM_ENTRIES[self.dtype]
        self.qk_entry = qk_rope_cpu.QK_NORM_ROPE_ENTRIES[self.dtype]
        self.eps = parts.input_norm.eps
        self.input_norm, self.post_norm = parts.input_norm.weight, parts.post_attention_norm.weight
        self.qkv_w, self.o_w = attn.qkv.weight, attn.o.weight
        self.q_norm = None if attn.q_norm is None else attn.q_norm.weight
        self.k_norm = None if attn.k_norm is None else attn.k_norm.weight
        self.qk_eps = 0.0 if attn.q_norm is None else attn.q_norm.eps
        self.heads, self.kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.scale = float(attn.scale)
        self.use_rope = attn.rope
        router, experts = moe.router, moe.experts
        self.gate, self.w13, self.w2 = router.gate.weight, experts.w13, experts.w2
        self.top_k, self.scoring, self.scaling = router.top_k, router.scoring, router.scaling
        self.renormalize = bool(router.renormalize)
        act = experts.activation
        self.activation = (act.name, float(act.alpha), float(act.limit))
        # adapter slots (r3srv.lora.slots; None without --enable-lora), read from the step's
        # LoraBatch as the modules read it; `act` and `linear` as the modules hand them over
        self.qkv_lora, self.o_lora, self.gate_lora, self.experts_lora = (attn.qkv.lora, attn.o.lora, router.gate.lora,
                                                                          experts.lora)
        self.act, self.linear, self.pack = act, linear, pack
        # each projection's packed copy as the backend's linear op reads it (kernels/linear_cpu.py)
        self.packed_weight = linear_cpu.packed_weight if pack_linear else _unpacked

    def __call__(self, x: torch.Tensor, cos, sin, meta, capture, step: DecodeStep) -> torch.Tensor | None:
        """The layer's output, or None where a kernel would decline this step (more rows than the
        Rust linear takes of one of its weights, an odd or too wide rotary part, activations or a
        cache of another dtype than the weights', or no cache yet): the caller runs the layer."""
        rows, hidden, threads = step.num_rows, x.shape[1], step.threads
        dtype, linear, norm = self.dtype, linear_cpu.linear_entry, self.norm_entry
        code = CODES[dtype]
        packed = self.packed_weight
        qkv_packed, o_packed, gate_packed = (packed(w, threads) for w in (self.qkv_w, self.o_w, self.gate))
        # more rows than one of the weights' limits (each at least MAX_ROWS): the modules' linear
        # op takes them another way
        limit = linear_cpu.row_limit
        if rows > linear_cpu.MAX_ROWS and rows > min(limit(qkv_packed, dtype), limit(o_packed, dtype),
                                                     limit(gate_packed, self.gate.dtype)):
            return None
        heads, kv_heads, head_dim = self.heads, self.kv_heads, self.head_dim
        rotary = cos.shape[-1] if self.use_rope else 0
        k_cache, v_cache = self.attn_layer.k_cache, self.attn_layer.v_cache
        if rotary % 2 or rotary > head_dim or k_cache is None or (x.dtype, k_cache.dtype, v_cache.dtype) != (dtype,) * 3:
            return None

        # attention: norm, q/k/v projection, q/k norms + RoPE, cache write, paged decode, output projection
        h = torch.empty_like(x)
        norm(x.data_ptr(), self.input_norm.data_ptr(), h.data_ptr(), rows, hidden, self.eps)
        qkv_w = self.qkv_w
        qkv = x.new_empty(rows, qkv_w.shape[0])
        linear((h.data_ptr(), qkv_w.data_ptr(), 0, qkv.data_ptr()), (rows, qkv_w.shape[0], hidden), code, threads,
               None, qkv_packed)
        if self.qkv_lora is not None:
            qkv = self.qkv_lora(h, qkv, self.linear, threads)
        q = x.new_empty(rows, heads, head_dim)
        k = x.new_empty(rows, kv_heads, head_dim)
        v = x.new_empty(rows, kv_heads, head_dim)
        normed = self.q_norm is not None
        addresses = (qkv.data_ptr(), self.q_norm.data_ptr() if normed else 0, self.k_norm.data_ptr() if normed else 0,
                     cos.data_ptr() if rotary else 0, sin.data_ptr() if rotary else 0, q.data_ptr(), k.data_ptr(),
                     v.data_ptr())
        self.qk_entry(addresses, (rows, heads, kv_heads, head_dim, rotary), self.qk_eps)
        write_kv = paged_decode_cpu.write_kv_cache_entry
        if write_kv is not None and k_cache.is_contiguous() and v_cache.is_contiguous():
            write_kv(code, k.data_ptr(), v.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), step.slots.data_ptr(),
                     rows, kv_heads * head_dim, k_cache.shape[0])
        else:
            k_cache.index_copy_(0, meta.slot_mapping, k)
            v_cache.index_copy_(0, meta.slot_mapping, v)
        o = x.new_empty(rows, heads, head_dim)
        head_major = paged_decode_cpu.head_major  # the wrapper's: pointers, shapes and the real strides
        paged_decode_cpu.paged_decode_entry(
            code, head_major("q", q), head_major("k_cache", k_cache), head_major("v_cache", v_cache), step.table_args,
            step.lens.data_ptr(), step.rows.data_ptr(), (o.data_ptr(), rows, heads, head_dim), step.block_size,
            self.scale, None, None, threads)
        o_w = self.o_w
        attended = torch.empty_like(x)
        linear((o.data_ptr(), o_w.data_ptr(), 0, attended.data_ptr()), (rows, hidden, o_w.shape[1]), code, threads,
               None, o_packed)
        if self.o_lora is not None:
            attended = self.o_lora(o.view(rows, -1), attended, self.linear, threads)
        x = x + attended

        # MoE: norm, router (a float32 gate takes the normed rows cast, as the modules cast them), expert pass
        h = torch.empty_like(x)
        norm(x.data_ptr(), self.post_norm.data_ptr(), h.data_ptr(), rows, hidden, self.eps)
        gate = self.gate
        experts = gate.shape[0]
        routed = h if gate.dtype is dtype else h.to(gate.dtype)
        gate_code = CODES[gate.dtype]
        logits = routed.new_empty(rows, experts)
        linear((routed.data_ptr(), gate.data_ptr(), 0, logits.data_ptr()), (rows, experts, hidden), gate_code,
               threads, None, gate_packed)
        if self.gate_lora is not None:  # an adapted router: the rows follow it
            logits = self.gate_lora(routed, logits, self.linear, threads)
        top_k = self.top_k
        weights = torch.empty(rows, top_k, dtype=F32)
        ids = torch.empty(rows, top_k, dtype=torch.int32)
        target = None if capture is None else (capture.data_ptr(), capture.stride(0), capture.element_size())
        router_cpu.route_experts_entry(logits.data_ptr(), gate_code, (rows, experts, top_k), self.scoring, self.renormalize,
                                  self.scaling, weights.data_ptr(), ids.data_ptr(), target)
        w13, w2 = self.w13, self.w2
        if self.experts_lora is not None and self.experts_lora.active():  # this step's adapters on the experts
            adapted = self.experts_lora.expert_pass(self.act, self.linear, threads)
            return x + adapted(h, w13, w2, weights, ids, b13=None, b2=None)
        num_experts, _, inter = w2.shape
        mixed = torch.empty_like(x)
        name, alpha, limit = self.activation
        addresses = (h.data_ptr(), w13.data_ptr(), w2.data_ptr(), 0, 0, 0, ids.data_ptr(), weights.data_ptr(),
                     mixed.data_ptr())
        packed = expert_pairs_cpu.packed_addresses(w13, w2, threads) if self.pack else None
        expert_pairs_cpu.expert_pairs_entry(addresses, (rows, rows * top_k, num_experts, hidden, inter), code, name, alpha,
                                           limit, threads, None, packed)
        return x + mixed
