"""The CPU backend: the Rust core's kernels where the settings and this build allow, torch's
paths otherwise, each chosen once when a model is built (`build`).

- linear layers of up to 32 rows (63 of a float32 weight, 64 of a bfloat16 one kept packed,
  `--[no-]packed-linear`),
  and bfloat16 ones of more where torch has no fast bfloat16 GEMM on this processor:
  kernels/linear_cpu.py (`--[no-]rust-linear`);
- float32 and bfloat16 RMSNorm: kernels/rms_norm_cpu.py (`--[no-]rust-rms-norm`);
- an attention layer's q/k norms and RoPE (float32, bfloat16): kernels/qk_rope_cpu.py (`--[no-]rust-rope`);
- paged decode attention (float32, bfloat16): kernels/paged_decode_cpu.py (`--[no-]rust-decode`);
- prefill attention (float32; bfloat16 in our AMX tiles where the CPU has them, else where torch
  lacks AMX, whose tiles run torch's flash attention several times faster than AVX-512 BF16
  dot products, `torch_prefills`): every prompt and chunk of a step of contexts up to
  RUST_PREFILL_MAX_CONTEXT (any length where the CPU has the dtype's flash kernel: AMX or
  AVX-512 BF16 for bfloat16, AVX-512F for float32; no window or sinks) in one call,
  kernels/paged_prefill_cpu.py (`--[no-]rust-prefill`; on more than one thread only for steps
  of RUST_THREADED_PREFILL_MIN_MACS where the kernels run on a pool of their own while torch's
  OpenMP threads spin, not on torch's team (kernels/kernel_threads.py, the default) or with the
  passive wait `r3srv serve` sets beside such a pool); longer ones (and all, off) SDPA per
  prompt, a chunk after cached tokens as two flash attentions merged by their log-sum-exps
  (ops/attention.py);
- routing without a correction bias or groups: kernels/router_cpu.py (`--[no-]rust-router`,
  `--force-torch-router`);
- the expert pass (float32, bfloat16: a prefill's products in AMX tiles where the CPU has them,
  `--[no-]amx-tiles`, which switches the prefill attention's too): kernels/expert_pairs_cpu.py
  (`--[no-]cpu-expert-kernel`), else torch's pair-by-pair, grouped or looped paths
  (`--[no-]grouped-mm`);
- with every one of those on, a plain MoE layer's whole decode step (float32 or bfloat16) as one
  fused op (ops/cpu_decode.py, `--[no-]fast-cpu-decode`).

Threads (`--cpu-threads`): the Rust kernels split their own work over all of them, threads
taking work from a shared counter, and only when a call is large enough; they run on torch's
OpenMP team (kernels/kernel_threads.py, `--[no-]openmp-kernel-threads`).
torch's OpenMP team gets them only for steps of many tokens (prefills), whose matmuls and
attention are large enough to split: a decode step issues hundreds of small ops, each a fork
and join where every thread waits for the slowest, and on a busy machine for a descheduled one
(docs/benchmarks.md).
"""

from __future__ import annotations

import functools

import torch

from r3srv.kernels import (cpu_isa, expert_pairs_cpu, kernel_threads, linear_cpu, paged_decode_cpu, paged_prefill_cpu,
                           qk_rope_cpu, rms_norm_cpu, router_cpu)
from r3srv.kernels.router_reference import route_reference
from r3srv.kernels.rust_core import RUST_DTYPES
from r3srv.ops import cpu_decode
from r3srv.ops.attention import prefill_attention, span_kernel
from r3srv.ops.experts import Activation, KernelExperts, TorchExperts
from r3srv.ops.linear import kernel_linear
from r3srv.ops.norm import REFERENCE_NORMS, kernel_rms_norm
from r3srv.ops.reference import no_fused_step
from r3srv.ops.rotary import ROTATIONS
from r3srv.ops.router import RouterShape, kernel_router
from r3srv.ops.table import Ops
from r3srv.preload import waits_passively
from r3srv.settings import Settings

# Prompts (or chunks) of longer contexts take SDPA: torch's flash attention overtakes the Rust
# kernel's above about this length (docs/benchmarks.md, benches/bench_prefill_attention.py).
RUST_PREFILL_MAX_CONTEXT = 1024
# On more than one thread, a step's prefill attention takes the Rust kernel from about this many
# multiply-adds (queries x context x heads x (head_dim + v_dim), the causal half not taken off):
# a 512-token prompt of Qwen3-30B-A3B's 32 heads of 128 is 2^31; the built-in model's 1,024 is 2^29
RUST_THREADED_PREFILL_MIN_MACS = 1 << 30
# Fewer tokens than this: torch runs the step on one thread.
TORCH_PARALLEL_MIN_TOKENS = 128
# Recurrent prefills scan alone: grouping padded sequences measured slower on the CPU, even for
# equal lengths (docs/benchmarks.md, benches/bench_hybrid_prefill.py)
SCAN_PAD_FACTOR = 0.0


def build(dtype: torch.dtype, current: Settings) -> Ops:
    threads = current.cpu_threads
    # the kernels' threads share the cores with OpenMP threads spinning after torch's ops only on
    # a pool of their own, and only while libgomp spins (beside one, r3srv serve has it wait passively)
    contended = kernel_threads.choose(current.openmp_kernel_threads) != "openmp" and not waits_passively()
    rust_dtype = dtype in RUST_DTYPES
    expert_pairs_cpu.allow_amx(current.amx_tiles)  # before torch_prefills asks what the flash kernel runs in
    linear = None
    if current.rust_linear and linear_cpu.BUILT:
        linear = kernel_linear(functools.partial(linear_cpu.linear_rust, pack=current.packed_linear), threads)
    norms = dict(REFERENCE_NORMS)
    if current.rust_rms_norm and rms_norm_cpu.BUILT:
        norms["default"] = kernel_rms_norm(functools.partial(rms_norm_cpu.rms_norm_cpu, threads=threads))
    heads = None
    if current.rust_rope and qk_rope_cpu.BUILT:
        heads = functools.partial(qk_rope_cpu.qk_norm_rope, threads=threads)
    decode = None
    if current.rust_decode and paged_decode_cpu.BUILT and rust_dtype:
        decode = functools.partial(paged_decode_cpu.paged_decode_cpu, threads=threads)
    prefill = functools.partial(prefill_attention, merged=True)
    if current.rust_prefill and paged_prefill_cpu.BUILT and rust_dtype and not torch_prefills(dtype):
        kernel = span_kernel(functools.partial(paged_prefill_cpu.paged_prefill_cpu, threads=threads),
                             RUST_PREFILL_MAX_CONTEXT, prefill, paged_prefill_cpu.flash_applies)
        prefill = large_steps_only(kernel, prefill) if threads > 1 and contended else kernel
    rust_router = current.rust_router and not current.force_torch_router and router_cpu.BUILT
    expert_kernel = current.cpu_expert_kernel and expert_pairs_cpu.BUILT
    packed = current.packed_experts
    grouped = "cpu" if current.grouped_mm else None

    def routers(shape: RouterShape):
        if rust_router and not shape.correction_bias and shape.num_groups == 1:
            return kernel_router(functools.partial(router_cpu.route_cpu, threads=threads))
        return route_reference

    def experts(activation: Activation):
        torch_pass = TorchExperts(activation, pairs_mv=True, grouped=grouped)
        if not expert_kernel or activation.name not in expert_pairs_cpu.ACTIVATIONS:
            return torch_pass
        return KernelExperts(functools.partial(expert_pairs_cpu.expert_pairs, threads=threads, pack=packed),
                             torch_pass)

    switches = (current.fast_cpu_decode, current.rust_linear, current.rust_rms_norm, current.rust_rope,
                current.rust_decode, current.cpu_expert_kernel, rust_router)
    fused = all(switches) and cpu_decode.kernels_built()

    def plan(x, meta, cos, sin, capture, num_experts, weights=None):
        return cpu_decode.DecodeStep.plan(x, meta, cos, sin, capture, num_experts, threads, weights)

    return Ops(
        name="cpu", linear=linear or torch.nn.functional.linear, norms=norms, rotations=ROTATIONS,
        attention_heads=heads, decode_attention=decode, prefill_attention=prefill,
        routers=routers, expert_passes=experts,
        recurrent_steps=no_fused_step, scan_pad_factor=SCAN_PAD_FACTOR,
        fuse_decoder_layer=(functools.partial(cpu_decode.fuse_decoder_layer, pack=packed,
                                              pack_linear=current.packed_linear) if fused else None),
        plan_fused_step=plan if fused else None,
        threads=threads, torch_threads=functools.partial(torch_threads, threads),
    )


def torch_prefills(dtype: torch.dtype) -> bool:
    """Whether a step's prefill attention of `dtype` stays with torch whatever the settings say:
    bfloat16 where torch runs it on AMX tiles and the Rust flash kernel does not (AMX tiles not
    allowed, or not granted)."""
    return (dtype == torch.bfloat16 and cpu_isa.torch_has_amx_bfloat16()
            and paged_prefill_cpu.flash_tiles(dtype) != "amx")


def large_steps_only(kernel, torch_path):
    """The prefill op on more than one thread while the kernels run on a pool of their own and
    torch's OpenMP threads spin between ops (libgomp's default): the kernel for a step of at
    least RUST_THREADED_PREFILL_MIN_MACS of attention, SDPA below. The spinning threads take the
    cores the kernel's threads need: a fixed delay that only a large call outweighs. On torch's
    team, or with a passive wait (r3srv.preload), the kernel wins at every size (docs/benchmarks.md)."""

    def prefill(q, k, v, k_cache, v_cache, spans, out, **kwargs) -> None:
        work = sum((s.end - s.start) * s.context_len for s in spans) * q.shape[1] * (q.shape[2] + v_cache.shape[-1])
        (kernel if work >= RUST_THREADED_PREFILL_MIN_MACS else torch_path)(q, k, v, k_cache, v_cache, spans, out, **kwargs)

    return prefill


def torch_threads(threads: int, num_tokens: int) -> int:
    """torch's intra-op threads for a CPU step of `num_tokens` tokens."""
    return threads if num_tokens >= TORCH_PARALLEL_MIN_TOKENS else 1
