"""Fused Triton router: one launch scores, limits the choice to the best expert groups (if
any), picks the top-k, renormalizes, scales and writes the ids into the routed-experts
capture row of the layer.

The same kernel source runs on CUDA and, with TRITON_INTERPRET=1, on CPU tensors in
Triton's interpreter (how the tests check it). The variable must be set before triton is
first imported: triton.jit reads it when it decorates, and triton.language's own jitted
helpers (tl.max, tl.sum, ...) are decorated at triton's import.
"""

from __future__ import annotations

import contextlib
import functools
from types import MappingProxyType

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from r3srv.kernels.launch import cdiv, next_power_of_2
from r3srv.kernels.router_reference import check_route_args

MAX_TOP_K = 16  # the top-k loop is unrolled; the routers we serve pick <= 10 (Qwen3-Next)
MAX_EXPERTS = 1024  # a program holds whole rows in registers
MAX_GROUPS = 32  # the group loops are unrolled; DeepSeek-V2/V3 use 8
TILE_ELEMENTS = 2048  # logits per program: enough work per program, few registers per thread


@triton.jit
def _best_groups(scores, valid, cols, group_size, BLOCK_T: tl.constexpr, NUM_GROUPS: tl.constexpr,
                 TOPK_GROUPS: tl.constexpr, GROUP_TOP: tl.constexpr, BLOCK_G: tl.constexpr):
    """[BLOCK_T, BLOCK_E] bool: experts of each row's TOPK_GROUPS best groups, a group scoring
    the sum of its GROUP_TOP best scores, equal group scores going to the lower group id."""
    gcols = tl.arange(0, BLOCK_G)
    group_scores = tl.full([BLOCK_T, BLOCK_G], float("-inf"), dtype=tl.float64)
    for g in tl.static_range(NUM_GROUPS):
        member = valid & ((cols >= g * group_size) & (cols < (g + 1) * group_size))[None, :]
        in_group = tl.where(member, scores, float("-inf"))
        top = tl.max(in_group, axis=1)
        total = top
        if GROUP_TOP == 2:
            # the second best: the best once the first (lowest id among equals) is set aside
            first = tl.min(tl.where(member & (in_group == top[:, None]), cols[None, :], 1 << 30), axis=1)
            second = tl.max(tl.where(cols[None, :] == first[:, None], float("-inf"), in_group), axis=1)
            total = top + tl.where(second == float("-inf"), 0.0, second)  # a one-expert group: its best alone
        group_scores = tl.where(gcols[None, :] == g, total[:, None], group_scores)
    group_open = (gcols < NUM_GROUPS)[None, :] & (group_scores == group_scores)
    kept = tl.zeros([BLOCK_T, BLOCK_G], dtype=tl.int1)
    for _ in tl.static_range(TOPK_GROUPS):
        best = tl.max(tl.where(group_open, group_scores, float("-inf")), axis=1)
        pick = tl.min(tl.where(group_open & (group_scores == best[:, None]), gcols[None, :], BLOCK_G), axis=1)
        kept = kept | (gcols[None, :] == pick[:, None])
        group_open = group_open & (gcols[None, :] != pick[:, None])
    eligible = tl.zeros(scores.shape, dtype=tl.int1)
    for g in tl.static_range(NUM_GROUPS):
        take = tl.max(tl.where(kept & (gcols[None, :] == g), 1, 0), axis=1) > 0
        member = ((cols >= g * group_size) & (cols < (g + 1) * group_size))[None, :]
        eligible = eligible | (member & take[:, None])
    return eligible


# Token count varies every step: don't specialize (and recompile) on it.
@triton.jit(do_not_specialize=["num_tokens"])
def _route_kernel(
    logits_ptr,
    bias_ptr,
    weights_ptr,
    ids_ptr,
    capture_ptr,
    num_tokens,
    num_experts,
    group_size,
    stride_lt,
    stride_le,
    stride_ct,
    stride_ck,
    scaling,
    TOP_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SIGMOID: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    HAS_CAPTURE: tl.constexpr,
    NUM_GROUPS: tl.constexpr,
    TOPK_GROUPS: tl.constexpr,
    GROUP_TOP: tl.constexpr,
    BLOCK_G: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < num_tokens
    valid = row_ok[:, None] & (cols < num_experts)[None, :]
    row_base = logits_ptr + rows.to(tl.int64) * stride_lt
    # Padding columns and rows load -inf: they never win a max and add 0 to softmax sums.
    x = tl.load(row_base[:, None] + cols[None, :] * stride_le, mask=valid, other=float("-inf")).to(tl.float32)

    if not SIGMOID:
        row_max = tl.where(row_ok, tl.max(x, axis=1), 0.0)
        denom = tl.where(row_ok, tl.sum(tl.exp(x - row_max[:, None]), axis=1), 1.0)

    # Rank keys, bit-identical to router_reference.choice_keys: the logits themselves
    # (softmax and sigmoid are monotone), or score + bias in float64. Expert groups are
    # scored on score (+ bias) in float64 too (router_reference.eligible_experts).
    if HAS_BIAS or NUM_GROUPS > 1:
        wide = x.to(tl.float64)
        if SIGMOID:
            scores = 1.0 / (1.0 + tl.exp(-wide))
        else:
            e = tl.exp(wide - row_max.to(tl.float64)[:, None])
            scores = e / tl.where(row_ok, tl.sum(e, axis=1), 1.0)[:, None]
        if HAS_BIAS:
            bias = tl.load(bias_ptr + cols, mask=cols < num_experts, other=0.0).to(tl.float64)
            scores = scores + bias[None, :]
        scores = tl.where(scores != scores, float("inf"), scores)
    if HAS_BIAS:
        keys = scores
    else:
        keys = x
    keys = tl.where(keys != keys, float("inf"), keys)  # NaN ranks as +inf, as in the reference

    avail = valid
    if NUM_GROUPS > 1:
        avail = valid & _best_groups(scores, valid, cols, group_size, BLOCK_T, NUM_GROUPS, TOPK_GROUPS, GROUP_TOP, BLOCK_G)

    slots = tl.arange(0, BLOCK_K)
    out_ids = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
    out_w = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    w_sum = tl.zeros([BLOCK_T], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        # Argmax with the lowest id among equal keys; `avail` (not a -inf mask) keeps
        # genuine -inf keys selectable in id order, as the stable sort does.
        best = tl.max(tl.where(avail, keys, float("-inf")), axis=1)
        hit = avail & (keys == best[:, None])
        idx = tl.min(tl.where(hit, cols[None, :], BLOCK_E), axis=1)
        avail = avail & (cols[None, :] != idx[:, None])
        # The chosen logit, re-read from L1 rather than gathered from the tile.
        x_j = tl.load(row_base + idx * stride_le, mask=row_ok & (idx < num_experts), other=0.0).to(tl.float32)
        if SIGMOID:
            w = 1.0 / (1.0 + tl.exp(-x_j))
        else:
            w = tl.exp(x_j - row_max)
            if not RENORMALIZE:
                w = w / denom
        w_sum += w
        out_ids = tl.where(slots[None, :] == j, idx[:, None], out_ids)
        out_w = tl.where(slots[None, :] == j, w[:, None], out_w)

    if RENORMALIZE:
        out_w = out_w / tl.where(row_ok, w_sum, 1.0)[:, None]
    out_w = out_w * scaling

    out_mask = row_ok[:, None] & (slots < TOP_K)[None, :]
    flat = rows.to(tl.int64)[:, None] * TOP_K + slots[None, :]
    tl.store(weights_ptr + flat, out_w, mask=out_mask)
    tl.store(ids_ptr + flat, out_ids, mask=out_mask)
    if HAS_CAPTURE:
        cap = capture_ptr + rows.to(tl.int64)[:, None] * stride_ct + slots[None, :] * stride_ck
        tl.store(cap, out_ids.to(capture_ptr.dtype.element_ty), mask=out_mask)


def interpreter_enabled() -> bool:
    """True when this process imported triton with TRITON_INTERPRET=1 (CPU tensors only)."""
    return isinstance(_route_kernel, InterpretedFunction)


@functools.lru_cache(maxsize=1024)  # one entry per layer shape: computing them per launch was host-bound
def kernel_constants(
    num_experts: int,
    top_k: int,
    *,
    scoring: str,
    has_bias: bool,
    renormalize: bool,
    has_capture: bool,
    num_groups: int = 1,
    topk_groups: int = 1,
    group_score_top: int = 2,
    block_t: int | None = None,
    num_warps: int | None = None,
) -> tuple[MappingProxyType, int]:
    """The kernel's constexpr arguments (read-only) and num_warps for one router shape.

    BLOCK_T depends on E only, so a model compiles one variant per layer shape whatever
    the batch size. `block_t` and `num_warps` override the defaults (the GPU benchmark sweeps them).
    """
    block_e = next_power_of_2(num_experts)
    if block_t is None:
        block_t = max(2, TILE_ELEMENTS // block_e)
    tile = block_t * block_e
    if num_warps is None:
        num_warps = 1 if tile <= 256 else 2 if tile <= 512 else 4 if tile <= 4096 else 8
    constants = MappingProxyType(dict(
        TOP_K=top_k,
        BLOCK_T=block_t,
        BLOCK_E=block_e,
        BLOCK_K=max(2, next_power_of_2(top_k)),  # no size-1 blocks: k=1 gets one masked slot
        SIGMOID=scoring == "sigmoid",
        HAS_BIAS=bool(has_bias),
        RENORMALIZE=bool(renormalize),
        HAS_CAPTURE=bool(has_capture),
        NUM_GROUPS=num_groups,
        TOPK_GROUPS=topk_groups,
        GROUP_TOP=group_score_top,
        BLOCK_G=max(2, next_power_of_2(num_groups)),
    ))
    return constants, num_warps


def route_triton(
    router_logits: torch.Tensor,
    top_k: int,
    *,
    scoring: str = "softmax",
    renormalize: bool = True,
    correction_bias: torch.Tensor | None = None,
    scaling: float = 1.0,
    capture: torch.Tensor | None = None,
    num_groups: int = 1,
    topk_groups: int = 1,
    group_score_top: int = 2,
    block_t: int | None = None,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`route_reference`, fused into one kernel launch (same arguments, same results).

    Needs CUDA tensors, or CPU tensors with TRITON_INTERPRET=1.
    """
    check_route_args(router_logits, top_k, scoring, correction_bias, capture, num_groups, topk_groups, group_score_top)
    num_tokens, num_experts = router_logits.shape
    if num_groups > MAX_GROUPS:
        raise ValueError(f"the fused router supports <= {MAX_GROUPS} expert groups, got {num_groups}; use route_reference")
    if top_k > MAX_TOP_K or num_experts > MAX_EXPERTS:
        raise ValueError(
            f"the fused router supports top_k <= {MAX_TOP_K} and <= {MAX_EXPERTS} experts, got top_k={top_k} "
            f"with {num_experts} experts; use route_reference"
        )
    if router_logits.is_cuda == interpreter_enabled():
        raise ValueError(
            f"the fused router runs on CUDA tensors, or on CPU tensors in a process started with "
            f"TRITON_INTERPRET=1; got router_logits on {router_logits.device} with the interpreter "
            f"{'on' if interpreter_enabled() else 'off'}"
        )
    if correction_bias is not None and correction_bias.device != router_logits.device:
        raise ValueError(f"correction_bias is on {correction_bias.device} but router_logits on {router_logits.device}")

    device = router_logits.device
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=device)
    ids = torch.empty((num_tokens, top_k), dtype=torch.int32, device=device)
    if num_tokens == 0:
        return weights, ids
    bias = correction_bias.contiguous() if correction_bias is not None else None
    constants, num_warps = kernel_constants(
        num_experts, top_k, scoring=scoring, has_bias=bias is not None, renormalize=renormalize,
        has_capture=capture is not None, num_groups=num_groups, topk_groups=topk_groups,
        group_score_top=group_score_top, block_t=block_t, num_warps=num_warps,
    )
    grid = (cdiv(num_tokens, constants["BLOCK_T"]),)
    # Triton launches on the current device; follow the tensors when they live elsewhere.
    on_other_gpu = router_logits.is_cuda and router_logits.device.index != torch.cuda.current_device()
    with torch.cuda.device(device) if on_other_gpu else contextlib.nullcontext():
        _route_kernel[grid](
            router_logits,
            bias if bias is not None else router_logits,  # unused when HAS_BIAS is False
            weights,
            ids,
            capture if capture is not None else ids,  # unused when HAS_CAPTURE is False
            num_tokens,
            num_experts,
            num_experts // num_groups,
            router_logits.stride(0),
            router_logits.stride(1),
            capture.stride(0) if capture is not None else 0,
            capture.stride(1) if capture is not None else 0,
            float(scaling),
            **constants,
            num_warps=num_warps,
            # Pinned (Triton 3.9 warns its default will change): no FMA contraction, so the
            # weights round the way the plain arithmetic reads.
            enable_fp_fusion=False,
        )
    return weights, ids


__all__ = ["MAX_EXPERTS", "MAX_GROUPS", "MAX_TOP_K", "interpreter_enabled", "kernel_constants", "route_triton"]
