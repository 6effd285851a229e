"""The batch-invariant CPU backend (`--batch-invariant`): every op computes each token's row the
same way whatever else is in the step, so a request's tokens, logprobs and routed experts are
bitwise the same alone, in any batch, in prefill chunks of any size, over the prefix cache and
after a preemption's recompute (docs/replay.md, "Determinism").

The CPU backend's kernels already compute a row independently of the others below a size, and
independently of their thread count; this backend keeps every call below that size and routes
prompt tokens through the kernels decodes take:

- linear layers: blocks of at most `linear_cpu.MAX_ROWS` rows through the Rust kernel, each
  output element one dot product (`gemm_nt`; with weights kept packed, --packed-linear, the
  packed products' sum, a row's own as well), never torch's GEMM, whose blocking depends on the
  number of rows (a row a call where the kernel declines);
- attention: every query, a prompt's as a decode's, through the Rust paged decode kernel over
  the keys up to its own position, in 32-key tiles from position 0 (the kernel's split is by
  sequence only), so a prompt chunk's size or a prefix hit changes nothing;
- the expert pass: experts kept packed (--packed-experts: float32 ones in row tiles on an
  AVX-512 CPU, bfloat16 ones in panels where the AVX-512 BF16 dot products run) in one call of
  the Rust kernel, whose every chunk then computes each element as one chain of its own pair's;
  other experts on runs of tokens that give no expert WIDE_MIN_PAIRS
  pairs, the count from which it is told to run an expert's pairs in wide chunks
  (rust/src/expert_pairs.rs);
- routing and a shared expert's sigmoid gate: one token a call (the Rust router computes rows
  apart already; torch's elementwise kernels take a vector or a scalar path by an element's
  place in the whole tensor);
- norms and q/k norms with RoPE: the CPU backend's row-by-row kernels as they are;
- no fused decode step (its sums differ from the modules' that prompts take), and torch on one
  thread (what is left of torch: elementwise ops and per-row reductions).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F

from r3srv.errors import ConfigError
from r3srv.kernels import expert_pairs_cpu, linear_cpu, paged_decode_cpu
from r3srv.ops.attention import PrefillSpan
from r3srv.ops.experts import Activation, ExpertPass, KernelExperts, TorchExperts
from r3srv.ops.linear import LinearFn
from r3srv.ops.router import RouteFn
from r3srv.ops.table import Ops

# The pair count from which the kernel runs an expert's pairs in wide chunks here, passed to it:
# their bits differ from the narrow products', in which each pair's are its own. Not the kernel's
# float32 default (16 where its pair panels run): blocks of tokens under 16 pairs an expert made
# this mode's float32 prefill pass 1.5-1.9x slower (docs/benchmarks.md)
WIDE_MIN_PAIRS = 64
# Queries per paged-kernel call of a prompt chunk: bounds the per-query block tables (ints) it builds
PREFILL_QUERY_BLOCK = 128


def build(base: Ops, packed_experts: bool = False, packed_linear: bool = False) -> Ops:
    """The CPU backend `base` (ops/cpu.py's, built for the same settings) made batch-invariant;
    `packed_experts`, `packed_linear`: the settings of those names."""
    missing = [name for name, built in (("linear_cpu", linear_cpu.BUILT), ("paged_decode_attention",
               paged_decode_cpu.BUILT), ("expert_pairs_cpu", expert_pairs_cpu.BUILT)) if not built]
    if missing:
        raise ConfigError(f"--batch-invariant needs the Rust core's {', '.join(missing)} (an extension built with "
                          "`pip install -e .`)")
    if base.decode_attention is None:
        raise ConfigError("--batch-invariant needs the Rust paged decode kernel: drop --no-rust-decode")
    threads = base.threads
    decode = base.decode_attention
    linear = functools.partial(invariant_linear, threads=threads, pack=packed_linear)
    return base.replace(
        name="cpu-invariant",
        linear=linear,
        prefill_attention=functools.partial(prefill_as_decodes, decode),
        expert_passes=lambda activation: KernelExperts(
            invariant_expert_pass(threads, packed_experts), TorchExperts(activation, pairs_mv=True, pairs_mv_always=True)),
        routers=lambda shape: row_by_row(base.routers(shape)),
        shared_gate=functools.partial(shared_gate_rows, linear=linear),
        fuse_decoder_layer=None, plan_fused_step=None,
        torch_threads=one_thread, batch_invariant=True,
    )


def row_by_row(route: RouteFn) -> RouteFn:
    """`route` one token at a time: torch's elementwise kernels (the reference router's sigmoid)
    take their vector or scalar path by an element's place in the whole tensor, so a row's
    scores would depend on the rows before it."""

    def route_rows(router_logits: torch.Tensor, top_k: int, *, capture=None, **kwargs):
        routed = [route(row, top_k, capture=None if capture is None else capture[i : i + 1], **kwargs)
                  for i, row in enumerate(router_logits.split(1))]
        if not routed:
            return route(router_logits, top_k, capture=capture, **kwargs)
        return torch.cat([w for w, _ in routed]), torch.cat([ids for _, ids in routed])

    return route_rows


def shared_gate_rows(x: torch.Tensor, weight: torch.Tensor, *, linear: LinearFn) -> torch.Tensor:
    """A shared expert's gate, sigmoid(x @ weight^T) through the backend's invariant `linear`, the
    sigmoid a token at a time (torch's over the step's whole column would take a vector or a
    scalar path by a token's place in it)."""
    logits = linear(x, weight)
    return torch.cat([torch.sigmoid(row) for row in logits.split(1)]) if logits.shape[0] else torch.sigmoid(logits)


def one_thread(num_tokens: int) -> int:
    return 1


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                     threads: int = 1, pack: bool = False) -> torch.Tensor:
    """F.linear, each row through the Rust kernel's per-row dot products (`pack`: a parameter's
    packed copy where the CPU reads one) in blocks of at most MAX_ROWS rows (or alone through
    F.linear where the kernel declines the weight)."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = rows.new_empty(rows.shape[0], weight.shape[0])
    for start in range(0, rows.shape[0], linear_cpu.MAX_ROWS):
        block = rows[start : start + linear_cpu.MAX_ROWS]
        y = linear_cpu.linear_rust(block, weight, bias, threads, pack)
        if y is None:  # a weight or dtype the kernel does not read: one row a call, a row alike at any batch
            y = torch.cat([F.linear(row, weight, bias) for row in block.split(1)])
        out[start : start + block.shape[0]] = y
    return out.view(*x.shape[:-1], weight.shape[0])


def prefill_as_decodes(decode, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, spans: list[PrefillSpan], out: torch.Tensor, *,
                       scale: float | None = None, window: int | None = None, sinks: torch.Tensor | None = None) -> None:
    """The prefill op (ops/attention.py's PrefillKernel) as one decode per query: query i of a
    span attends through the paged decode kernel `decode` over its context's first
    `context_len - q_len + i + 1` keys, read from the cache (written before this call) through a
    table of single-slot pages. The kernel's tiles start at position 0 whatever the page, so a
    query gets the bits the same token gets as a decode."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    for span in spans:
        slots = span.context_slots if span.context_slots is not None else span.slots
        if slots is None:
            raise ValueError("a prefill span without its slots (AttentionMetadata.build gives them)")
        q_len, ctx = span.end - span.start, span.context_len
        # built once per span, on the queries' device: one table row per query of a block, each
        # query's context length and its row in `out`
        tables = slots.to(torch.int64).view(1, -1).expand(min(q_len, PREFILL_QUERY_BLOCK), -1).contiguous()
        lens = torch.arange(ctx - q_len + 1, ctx + 1, dtype=torch.int64, device=q.device)
        rows = torch.arange(span.start, span.end, dtype=torch.int64, device=q.device)
        for first in range(0, q_len, PREFILL_QUERY_BLOCK):
            n = min(PREFILL_QUERY_BLOCK, q_len - first)
            decode(q, k_cache, v_cache, tables[:n], lens[first : first + n], rows[first : first + n], out, page=1,
                   scale=scale, window=window, sinks=sinks, max_context=ctx)


def narrow_blocks(pair_tokens: torch.Tensor, ids: torch.Tensor, num_tokens: int, num_experts: int,
                  limit: int = WIDE_MIN_PAIRS) -> list[tuple[int, int]]:
    """Runs of tokens [start, end), greedily as long as possible, in which no expert receives
    `limit` of the pairs (pair p belongs to token pair_tokens[p] and goes to expert ids[p])."""
    counts = torch.zeros(num_tokens, num_experts, dtype=torch.int32)
    counts.index_put_((pair_tokens.long(), ids.long()), torch.ones(ids.shape[0], dtype=torch.int32), accumulate=True)
    cumulative = counts.cumsum(0)
    blocks, start = [], 0
    while start < num_tokens:
        before = cumulative[start - 1] if start else torch.zeros(num_experts, dtype=cumulative.dtype)
        over = ((cumulative[start:] - before) >= limit).any(1).nonzero()
        end = num_tokens if not over.numel() else start + max(1, int(over[0, 0]))
        blocks.append((start, end))
        start = end
    return blocks


def invariant_expert_pass(threads: int, packed: bool) -> ExpertPass:
    """The Rust expert pass as this backend runs it: experts that have a packed copy (`packed`
    and expert_pairs_cpu.packed_experts) in one call, the whole step's pairs, as each element is
    its pair's own chain in any chunk (no blocks of tokens: a prefill's
    experts run wide); any other through `blocked_kernel`."""
    whole = functools.partial(expert_pairs_cpu.expert_pairs, threads=threads, pack=True)
    blocked = blocked_kernel(functools.partial(expert_pairs_cpu.expert_pairs, threads=threads,
                                               wide_min_pairs=WIDE_MIN_PAIRS))

    def run(x, w13, w2, weights, ids, tokens, b13, b2, act) -> torch.Tensor | None:
        kernel = whole if packed and expert_pairs_cpu.packed_experts(w13, w2, threads) is not None else blocked
        return kernel(x, w13, w2, weights, ids, tokens, b13, b2, act)

    return run


def blocked_kernel(kernel: ExpertPass) -> ExpertPass:
    """The Rust expert pass `kernel` over runs of tokens that keep every expert below the
    kernel's WIDE_MIN_PAIRS pairs (`narrow_blocks`; an expert-parallel rank's pairs by the
    tokens they belong to); None (KernelExperts' torch fallback) where it declines the layer."""

    def run(x, w13, w2, weights, ids, tokens, b13, b2, act) -> torch.Tensor | None:
        num_tokens = x.shape[0]
        pair_tokens = torch.arange(num_tokens).repeat_interleave(ids.shape[-1]) if tokens is None else tokens
        out = torch.empty_like(x) if tokens is None else torch.zeros_like(x)
        for start, end in narrow_blocks(pair_tokens, ids.reshape(-1), num_tokens, w13.shape[0]):
            if tokens is None:
                part = kernel(x[start:end], w13, w2, weights[start:end], ids[start:end], None, b13, b2, act)
                if part is None:
                    return None
                out[start:end] = part
                continue
            mine = ((tokens >= start) & (tokens < end)).nonzero().squeeze(1)
            if not mine.numel():
                continue
            part = kernel(x, w13, w2, weights[mine], ids[mine], tokens[mine], b13, b2, act)
            if part is None:
                return None
            out[start:end] = part[start:end]
        return out

    return run


def build_cuda(base: Ops) -> Ops:
    """The CUDA backend `base` (ops/cuda.py's) made batch-invariant: linear layers through
    kernels/linear_triton.py (fixed tiles, no split-K), every query through the Triton paged
    decode kernel unsplit (its key tiles start at position 0 whatever the page), the expert pass
    as `PairExperts` over that linear, routing and a shared expert's gate a token at a time."""
    from r3srv.ops.cuda import triton_available

    if not triton_available():
        raise ConfigError("--batch-invariant on CUDA needs triton (its kernels are Triton's)")
    from r3srv.kernels.linear_triton import linear_triton
    from r3srv.kernels.paged_decode_triton import paged_decode_triton

    decode = functools.partial(paged_decode_triton, splits=1)
    return base.replace(
        name="cuda-invariant", linear=linear_triton, decode_attention=decode,
        prefill_attention=functools.partial(prefill_as_decodes, decode),
        expert_passes=lambda activation: PairExperts(activation, linear_triton),
        routers=lambda shape: row_by_row(base.routers(shape)),
        shared_gate=functools.partial(shared_gate_rows, linear=linear_triton), batch_invariant=True,
    )


@dataclasses.dataclass(frozen=True)
class PairExperts:
    """The expert pass through an invariant `linear`: each expert's pairs as two projections of
    rows that do not depend on each other, then each token's weighted outputs summed in its pairs'
    order, one round per rank of a pair within its token (no atomics: each round adds to a token
    at most once)."""

    act: Activation
    linear: LinearFn

    def __call__(self, x, w13, w2, weights, ids, *, tokens=None, b13=None, b2=None) -> torch.Tensor:
        if not ids.numel():
            return torch.zeros_like(x)
        flat_ids, flat_weights = ids.reshape(-1).long(), weights.reshape(-1)
        pair_tokens = (torch.arange(x.shape[0], device=x.device).repeat_interleave(ids.shape[-1]) if tokens is None
                       else tokens.long())
        outputs = x.new_empty(flat_ids.shape[0], x.shape[1])
        for expert in flat_ids.unique().tolist():
            pairs = (flat_ids == expert).nonzero().squeeze(1)
            h = self.linear(x.index_select(0, pair_tokens.index_select(0, pairs)), w13[expert])
            if b13 is not None:
                h = h + b13[expert]
            o = self.linear(self.act(h), w2[expert])
            if b2 is not None:
                o = o + b2[expert]
            outputs[pairs] = o * flat_weights.index_select(0, pairs)[:, None].to(o.dtype)
        rank, rounds = _ranks_in_token(pair_tokens, ids.shape[-1], tokens is None)
        out = torch.zeros_like(x)
        for r in range(rounds):
            pairs = (rank == r).nonzero().squeeze(1)
            out.index_add_(0, pair_tokens.index_select(0, pairs), outputs.index_select(0, pairs))
        return out


def _ranks_in_token(pair_tokens: torch.Tensor, top_k: int, token_major: bool) -> tuple[torch.Tensor, int]:
    """Each pair's place among its token's pairs, and how many places there are. Token-major
    pairs (the ids' own [tokens, top_k] order) are ranked by position alone, without a sort or a
    host read; pairs given with their tokens (expert parallelism's) are ranked by a stable sort."""
    if token_major:
        return torch.arange(pair_tokens.shape[0], device=pair_tokens.device) % top_k, top_k
    order = torch.argsort(pair_tokens, stable=True)
    sorted_tokens = pair_tokens.index_select(0, order)
    first = torch.searchsorted(sorted_tokens, sorted_tokens)  # each pair's token's first place
    rank = torch.empty_like(order).scatter_(0, order, torch.arange(order.shape[0], device=pair_tokens.device) - first)
    return rank, int(rank.max()) + 1
