"""Parallel-aware building blocks: linear layers, embedding, LM head and experts that hold one
rank's shard of their weights and say, on every checkpoint target they hand the loader, which
slice of the checkpoint tensor that shard is (so each rank reads only its slice).

At size 1 (`SINGLE`, no torch.distributed) every block computes what a plain `F.linear` /
`F.embedding` on the whole weight does, with the same calls (the linear layers through their
backend's linear op, `ops.linear`: on the CPU a few rows take the Rust kernel).

- Column-parallel: output rows split. A merged layer (q/k/v, gate/up, a recurrent layer's
  in_proj) stacks several sub-matrices, each split on its own (`Piece`), so a rank holds its
  slice of every one. Outputs stay split: the next row-parallel layer takes them as they are.
- Row-parallel: input columns split; one all-reduce of the partial products (bias added once).
- Heads: `head_pieces` splits heads over ranks; fewer KV heads than ranks are replicated, each
  rank holding the one head its query heads read (vLLM's rule).
- Vocab-parallel embedding and LM head: vocabulary rows split (padded up to equal slices).
- Experts: expert parallelism gives each rank a contiguous slice of the experts, whole, and
  each rank runs only the (token, slot) pairs routed to them; tensor parallelism (without EP)
  gives each rank a slice of every expert's intermediate size. Routers run whole on every
  rank, so expert ids stay logical (global) everywhere, routed-experts capture included.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from r3srv.ops import REFERENCE, Ops
from r3srv.ops.parts import LinearParts
from r3srv.settings import EP_DISPATCHES


@dataclass(frozen=True)
class ParallelState:
    """This rank's place: tensor-parallel rank and size, expert-parallel rank and size, and the
    torch.distributed group the collectives run on (None at size 1: nothing is called)."""

    tp_rank: int = 0
    tp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    group: Any = None
    # how expert parallelism combines (docs/parallelism.md): "all_reduce" (each rank runs its
    # experts' pairs of every token, one all-reduce) or "all_to_all" (tokens dispatched)
    ep_dispatch: str = "all_reduce"
    # --batch-invariant: all_reduce adds the ranks' partials in rank order on every rank (gloo's
    # and NCCL's all-reduce order an element's sum by its place in the buffer, so by the batch)
    sum_in_rank_order: bool = False

    def __post_init__(self) -> None:
        if not (0 <= self.tp_rank < self.tp_size and 0 <= self.ep_rank < self.ep_size):
            raise ValueError(f"ranks outside their sizes: {self}")
        # one group: expert parallelism spans the tensor-parallel ranks (vLLM's EP without data parallelism)
        if self.ep_size not in (1, self.tp_size):
            raise ValueError(f"ep_size {self.ep_size} must be 1 or tp_size {self.tp_size}")
        if self.ep_dispatch not in EP_DISPATCHES:
            raise ValueError(f"ep_dispatch {self.ep_dispatch!r} is not one of {EP_DISPATCHES}")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over the group's ranks (x itself at size 1), into x."""
        if self.tp_size == 1:
            return x
        if not self.sum_in_rank_order:
            torch.distributed.all_reduce(x, group=self.group)
            return x
        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        torch.distributed.all_gather(parts, x.contiguous(), group=self.group)
        x.copy_(parts[0])
        for part in parts[1:]:  # ((x0 + x1) + x2) + ...: one order whatever the batch
            x.add_(part)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' x concatenated along the last dim, rank by rank (x itself at size 1)."""
        if self.tp_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        torch.distributed.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


SINGLE = ParallelState()


# ---- what a target's shard is -------------------------------------------------------------
@dataclass(frozen=True)
class Piece:
    """One sub-matrix of a tensor along its split dim: `size` rows (or columns) in the
    checkpoint, cut in `count` slices of ceil(size / count), of which this rank holds `index`
    (the last slice may be short: padded vocabularies)."""

    size: int
    index: int = 0
    count: int = 1

    @property
    def local(self) -> int:
        """Rows this rank allocates (the padded slice)."""
        return math.ceil(self.size / self.count)

    @property
    def start(self) -> int:
        return min(self.index * self.local, self.size)

    @property
    def stop(self) -> int:
        return min(self.start + self.local, self.size)


@dataclass(frozen=True)
class Split:
    """How a checkpoint tensor is cut along `dim`: the sub-matrices stacked there, in order."""

    dim: int
    pieces: tuple[Piece, ...]

    @property
    def whole(self) -> bool:
        return all(p.count == 1 for p in self.pieces)

    def ranges(self) -> list[tuple[int, int]]:
        """This rank's [start, stop) along dim of the checkpoint tensor, one per piece."""
        ranges, offset = [], 0
        for p in self.pieces:
            ranges.append((offset + p.start, offset + p.stop))
            offset += p.size
        return ranges

    def checkpoint_size(self) -> int:
        return sum(p.size for p in self.pieces)


def shard_of(target: torch.Tensor) -> tuple[Split, ...]:
    """The splits a checkpoint target carries (none: the whole tensor)."""
    return getattr(target, "splits", ())


def with_splits(target: torch.Tensor, *splits: Split) -> torch.Tensor:
    """target, marked as holding these slices of its checkpoint tensor (tensor views take
    attributes; a fresh view is made per weight_targets call)."""
    target.splits = tuple(s for s in splits if not s.whole)
    return target


def transposed(target: torch.Tensor) -> torch.Tensor:
    """target with its last two dims swapped, its splits following them."""
    last = target.dim() - 1
    swap = {last: last - 1, last - 1: last}
    return with_splits(target.transpose(-1, -2), *(replace(s, dim=swap.get(s.dim, s.dim)) for s in shard_of(target)))


def checkpoint_shape(target: torch.Tensor) -> tuple[int, ...]:
    """The shape of the whole checkpoint tensor a target holds a slice of."""
    shape = list(target.shape)
    for split in shard_of(target):
        shape[split.dim] = split.checkpoint_size()
    return tuple(shape)


def loaded_numel(param: torch.Tensor) -> int:
    """Elements of a parameter its checkpoint fills (a padded vocabulary slice's padding is not)."""
    return param.numel() - getattr(param, "padding", 0)


def split_evenly(size: int, rank: int, count: int) -> Piece:
    if size % count:
        raise ValueError(f"{size} does not split over {count} ranks")
    return Piece(size, rank, count)


def head_pieces(num_heads: int, head_dim: int, state: ParallelState = SINGLE) -> Piece:
    """num_heads heads of head_dim rows, split over the tensor-parallel ranks; fewer heads than
    ranks (GQA's KV heads) are replicated: rank r holds head r * num_heads // tp_size."""
    tp = state.tp_size
    if num_heads >= tp:
        return split_evenly(num_heads * head_dim, state.tp_rank, tp)
    if tp % num_heads:
        raise ValueError(f"{num_heads} heads cannot be replicated over {tp} ranks")
    return Piece(num_heads * head_dim, state.tp_rank * num_heads // tp, num_heads)


def local_heads(num_heads: int, state: ParallelState = SINGLE) -> int:
    """Heads one rank holds (at least one: replicated KV heads)."""
    return max(1, num_heads // state.tp_size)


def _empty(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


# ---- a weight split along one dim -------------------------------------------------------
class ShardedWeight(nn.Module):
    """A weight (and optional bias) split along `dim` into pieces; `part(i)` / `bias_part(i)`
    are the checkpoint targets of piece i (None: all pieces, the whole merged tensor)."""

    ops: Ops = REFERENCE  # the model's backend, bound by use_ops when the model is built
    lora = None  # a linear layer's adapter slots (r3srv.lora.slots.LoraLinear) when served with LoRA

    def use_ops(self, ops: Ops) -> None:
        self.ops = ops

    def parts(self) -> LinearParts:
        """The weight and bias as a layer hands them to a fused op (ops/parts.py)."""
        return LinearParts(self.weight, self.bias, self.lora)

    def __init__(self, pieces: Sequence[Piece], shape: Sequence[int], dim: int, *, bias: bool,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.pieces, self.dim = tuple(pieces), dim
        self.offsets = [0]
        for p in self.pieces:
            self.offsets.append(self.offsets[-1] + p.local)
        full = list(shape)
        full[dim] = self.offsets[-1]
        self.weight = _empty(*full, dtype=dtype, device=device)
        # a split-input layer's bias is whole (added once); a split-output one's is split
        self.bias = None
        if bias:
            self.bias = _empty(full[0], dtype=dtype, device=device)

    def _view(self, tensor: torch.Tensor, dim: int, first: int, last: int) -> torch.Tensor:
        pieces = self.pieces[first : last + 1]
        if any(p.stop - p.start != p.local for p in pieces[:-1]):
            raise ValueError("only the last piece of a target may be a short (padded) slice")
        view = tensor.narrow(dim, self.offsets[first], sum(p.stop - p.start for p in pieces))
        return with_splits(view, Split(dim, pieces))

    def part(self, first: int | None = None, last: int | None = None) -> torch.Tensor:
        """The weight rows of pieces first..last (inclusive; None: all) as a checkpoint target."""
        first, last = (0, len(self.pieces) - 1) if first is None else (first, first if last is None else last)
        return self._view(self.weight, self.dim, first, last)

    def bias_part(self, first: int | None = None, last: int | None = None) -> torch.Tensor | None:
        if self.bias is None:
            return None
        if self.dim != 0:  # a row-parallel layer's bias is whole
            return self.bias
        first, last = (0, len(self.pieces) - 1) if first is None else (first, first if last is None else last)
        return self._view(self.bias, 0, first, last)


class ColumnParallelLinear(ShardedWeight):
    """y = x W^T (+ b) for this rank's output rows; `pieces` the sub-matrices stacked in W
    (one for a plain layer, q/k/v or gate/up for a merged one)."""

    def __init__(self, in_features: int, pieces: Sequence[Piece] | Piece, *, bias: bool = False,
                 dtype: torch.dtype, device: torch.device) -> None:
        pieces = (pieces,) if isinstance(pieces, Piece) else tuple(pieces)
        super().__init__(pieces, (0, in_features), 0, bias=bias, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ops.linear(x, self.weight, self.bias)
        return y if self.lora is None else self.lora(x, y, self.ops.linear, self.ops.threads)


class RowParallelLinear(ShardedWeight):
    """y = x W^T (+ b) with x and W's columns split: partial products all-reduced, b added once."""

    def __init__(self, piece: Piece, out_features: int, *, bias: bool = False, state: ParallelState = SINGLE,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__((piece,), (out_features, 0), 1, bias=bias, dtype=dtype, device=device)
        self.state = state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.state.tp_size == 1:
            y = self.ops.linear(x, self.weight, self.bias)
            return y if self.lora is None else self.lora(x, y, self.ops.linear, self.ops.threads)
        y = self.ops.linear(x, self.weight)
        if self.lora is not None:  # this rank's input columns of A: the ranks' terms sum to the whole
            y = self.lora(x, y, self.ops.linear, self.ops.threads)
        y = self.state.all_reduce(y)
        return y if self.bias is None else y + self.bias


def column_weight(pieces: Sequence[Piece] | Piece, *rest: int, dtype: torch.dtype, device: torch.device,
                  bias: bool = False) -> ShardedWeight:
    """A weight split on its first dim that is not a linear layer's (a convolution's, a per-head vector)."""
    pieces = (pieces,) if isinstance(pieces, Piece) else tuple(pieces)
    return ShardedWeight(pieces, (0, *rest), 0, bias=bias, dtype=dtype, device=device)


# ---- vocabulary ---------------------------------------------------------------------------
class VocabParallelEmbedding(ShardedWeight):
    """Embedding rows split over the tensor-parallel ranks (slices padded to equal length): a
    rank looks up the ids it holds, zeros for the others, and the ranks' rows are summed."""

    def __init__(self, vocab_size: int, hidden_size: int, *, state: ParallelState = SINGLE, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__((Piece(vocab_size, state.tp_rank, state.tp_size),), (0, hidden_size), 0, bias=False,
                         dtype=dtype, device=device)
        self.state, self.vocab_size = state, vocab_size
        piece = self.pieces[0]
        with torch.no_grad():  # the padding rows of the last slice: no token, zero logits (dropped)
            self.weight[piece.stop - piece.start :].zero_()
        self.weight.padding = (piece.local - (piece.stop - piece.start)) * hidden_size

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.state.tp_size == 1:
            return F.embedding(ids, self.weight)
        piece = self.pieces[0]
        local = ids - piece.start
        outside = (ids < piece.start) | (ids >= piece.stop)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.state.all_reduce(x.masked_fill(outside[:, None], 0))


class ParallelLMHead(nn.Module):
    """Logits over the whole vocabulary from split vocabulary rows (its own, or a tied
    embedding's): each rank's slice, gathered."""

    ops: Ops = REFERENCE

    def use_ops(self, ops: Ops) -> None:
        self.ops = ops

    def __init__(self, embedding: VocabParallelEmbedding, tied: bool, *, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.state, self.vocab_size = embedding.state, embedding.vocab_size
        self.rows = embedding if tied else VocabParallelEmbedding(self.vocab_size, embedding.weight.shape[1],
                                                                  state=self.state, dtype=dtype, device=device)

    @property
    def weight(self) -> torch.Tensor:
        return self.rows.weight

    def part(self) -> torch.Tensor:
        return self.rows.part()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.ops.linear(x, self.rows.weight)
        if self.state.tp_size == 1:
            return logits
        return self.state.all_gather(logits)[..., : self.vocab_size]


# ---- experts ------------------------------------------------------------------------------
class ExpertSlice(nn.Module):
    """The routed experts this rank holds, stacked: w13 [E_local, (2) I_local, H] (gate rows
    then up rows, or gpt-oss's interleaved ones, or up rows alone), w2 [E_local, H, I_local].

    Expert parallelism: experts first .. first + E_local - 1 (a contiguous slice of the logical
    ids), whole. Otherwise every expert, its intermediate size split over the tensor-parallel
    ranks. Ids in and out are logical; a rank computes its share of each token's weighted sum,
    and the shares are summed over the ranks.
    """

    lora = None  # the experts' adapter slots (r3srv.lora.slots.LoraExperts) when served with LoRA

    def __init__(self, num_experts: int, hidden: int, intermediate: int, *, gated: bool, interleaved: bool = False,
                 biased: bool = False, state: ParallelState = SINGLE, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.state, self.num_experts = state, num_experts
        ep, tp = (state.ep_rank, state.ep_size), (state.tp_rank, state.tp_size)
        if state.ep_size > 1:
            tp = (0, 1)  # whole experts: no intermediate split
        self.expert_piece = split_evenly(num_experts, *ep)
        self.inter_piece = split_evenly(intermediate, *tp)
        self.first, self.count = self.expert_piece.start, self.expert_piece.local
        inter = self.inter_piece.local
        # gate rows then up rows (two pieces), gpt-oss's interleaved pairs (one of 2I), or up rows
        self.up_pieces = (self.inter_piece,) * (2 if gated else 1)
        if interleaved:
            self.up_pieces = (Piece(2 * intermediate, *self._tp()),)
        kw = dict(dtype=dtype, device=device)
        self.w13 = _empty(self.count, (2 if gated else 1) * inter, hidden, **kw)
        self.w2 = _empty(self.count, hidden, inter, **kw)
        self.b13 = _empty(self.count, 2 * inter, **kw) if biased else None
        self.b2 = _empty(self.count, hidden, **kw) if biased else None

    @property
    def local_ids(self) -> range:
        """The logical ids of the experts this rank holds."""
        return range(self.first, self.first + self.count)

    @property
    def reduces(self) -> bool:
        return self.state.tp_size > 1

    # ---- checkpoint targets ---------------------------------------------------------------
    def _experts(self, tensor: torch.Tensor, expert: int | None) -> tuple[torch.Tensor, list[Split]]:
        if expert is None:
            return tensor, [Split(0, (self.expert_piece,))]
        return tensor[expert - self.first], []

    def w13_part(self, expert: int | None = None, piece: int | None = None) -> torch.Tensor:
        """Expert `expert`'s (logical id; None: all local experts, the fused 3-D tensor) gate
        (piece 0) or up (piece 1) rows, or both (None)."""
        tensor, splits = self._experts(self.w13, expert)
        dim = tensor.dim() - 2
        pieces = self.up_pieces if piece is None else (self.up_pieces[piece],)
        lo = 0 if piece is None else piece * self.inter_piece.local
        view = tensor.narrow(dim, lo, sum(p.local for p in pieces))
        return with_splits(view, *splits, Split(dim, pieces))

    def w2_part(self, expert: int | None = None) -> torch.Tensor:
        tensor, splits = self._experts(self.w2, expert)
        return with_splits(tensor[...], *splits, Split(tensor.dim() - 1, (self.inter_piece,)))

    def bias_parts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The fused [E, 2I] and [E, H] biases (gpt-oss)."""
        expert = Split(0, (self.expert_piece,))
        return with_splits(self.b13[...], expert, Split(1, self.up_pieces)), with_splits(self.b2[...], expert)

    def _tp(self) -> tuple[int, int]:
        return self.inter_piece.index, self.inter_piece.count

    # ---- forward --------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                run: Callable[..., torch.Tensor]) -> torch.Tensor:
        """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]) (logical ids [T, k]) through
        `run(x, w13, w2, weights, ids, tokens=, b13=, b2=)`, the backend's expert pass
        (ops/experts.py: ids [T, k], or a pair list with `tokens`)."""
        if self.state.ep_size > 1:
            dispatch = _all_to_all if self.state.ep_dispatch == "all_to_all" else _own_pairs_all_reduced
            return dispatch(self, x, weights, ids, run)
        if not self.reduces:
            return run(x, self.w13, self.w2, weights, ids, b13=self.b13, b2=self.b2)
        b2 = self.b2 if self.inter_piece.index == 0 else None  # a split expert's bias added once
        return self.state.all_reduce(run(x, self.w13, self.w2, weights, ids, b13=self.b13, b2=b2))

    def owns(self, ids: torch.Tensor) -> torch.Tensor:
        """Which of these logical ids are this rank's experts."""
        return (ids >= self.first) & (ids < self.first + self.count)


def _own_pairs_all_reduced(experts: ExpertSlice, x, weights, ids, run) -> torch.Tensor:
    """Expert parallelism over replicated tokens: each rank runs only the (token, slot) pairs
    of its own experts into a [T, H] partial sum, and one all-reduce combines the ranks'."""
    tokens, slots = experts.owns(ids).nonzero(as_tuple=True)
    out = run(x, experts.w13, experts.w2, weights[tokens, slots], ids[tokens, slots] - experts.first, tokens=tokens,
              b13=experts.b13, b2=experts.b2)
    return experts.state.all_reduce(out)


def _all_to_all(experts: ExpertSlice, x, weights, ids, run) -> torch.Tensor:
    """Expert parallelism by dispatch: each rank takes a contiguous 1/N of the tokens, sends
    each of their (token, slot) rows to the rank owning the expert (all_to_all_single), the
    owners run them and send the outputs back (all_to_all_single), each rank sums its
    tokens' weighted outputs, and an all-gather makes [T, H] whole again.

    The router ran identically on every rank, so every rank knows every pair: the counts
    and the expert ids of the rows it will receive are computed here, not exchanged."""
    state, group = experts.state, experts.state.group
    n, rank, per_rank = state.ep_size, state.ep_rank, experts.count
    num_tokens, top_k = ids.shape
    bounds = [num_tokens * r // n for r in range(n + 1)]
    # this rank's tokens' pairs, sorted by expert id and so by owner rank
    share_ids = ids[bounds[rank] : bounds[rank + 1]].reshape(-1).long()
    order = torch.argsort(share_ids, stable=True)
    send_counts = torch.bincount(share_ids // per_rank, minlength=n).tolist()
    send_rows = x[bounds[rank] : bounds[rank + 1]].index_select(0, order // top_k)
    # the rows each rank sends here: its share's pairs of this rank's experts, in expert order
    received = []
    for r in range(n):
        theirs = ids[bounds[r] : bounds[r + 1]].reshape(-1)
        received.append(torch.sort(theirs[experts.owns(theirs)], stable=True).values)
    recv_counts = [len(e) for e in received]
    recv_ids = torch.cat(received).long() - experts.first
    recv_rows = x.new_empty(len(recv_ids), x.shape[1])
    torch.distributed.all_to_all_single(recv_rows, send_rows, recv_counts, send_counts, group=group)
    # each received row is its own "token": weight 1 here, the token's rank applies its weight
    ones = torch.ones(len(recv_ids), dtype=weights.dtype, device=x.device)
    outputs = run(recv_rows, experts.w13, experts.w2, ones, recv_ids,
                  tokens=torch.arange(len(recv_ids), device=x.device), b13=experts.b13, b2=experts.b2)
    returned = torch.empty_like(send_rows)
    torch.distributed.all_to_all_single(returned, outputs, send_counts, recv_counts, group=group)
    returned.mul_(weights[bounds[rank] : bounds[rank + 1]].reshape(-1)[order].to(returned.dtype)[:, None])
    # shares padded to one length for the all-gather
    width = -(-num_tokens // n)
    share = x.new_zeros(width, x.shape[1]).index_add_(0, order // top_k, returned)
    parts = [torch.empty_like(share) for _ in range(n)]
    torch.distributed.all_gather(parts, share, group=group)
    return torch.cat([part[: bounds[r + 1] - bounds[r]] for r, part in enumerate(parts)])


def reshaped(target: torch.Tensor, *shape: int, dim: int) -> torch.Tensor:
    """A 1-D target viewed as `shape` (a checkpoint's [1, 1, H, 1]), its split moved to `dim`."""
    return with_splits(target.view(*shape), *(replace(s, dim=dim) for s in shard_of(target)))
