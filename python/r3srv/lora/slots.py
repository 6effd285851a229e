"""The layers' adapter slots and the low-rank passes a step runs through them.

A model served with LoRA has `max_loras` slots. Every projection an adapter may target holds a
`LoraLinear` (linear layers, the router gate) or a `LoraExperts` (a MoE layer's routed experts),
with one low-rank pair per slot that adapts it (None: the adapter in that slot leaves it as in
the base). A step's `LoraBatch` says which slot each token runs under (-1: the base model); one
forward runs every adapter of the step together: per projection, one low-rank pass per slot
present (a few rows each in a decode), through the backend's own linear op (on the CPU the Rust
kernel of a few rows), never one forward per adapter.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from r3srv.lora import cpu_kernel
from r3srv.ops.experts import Activation

LinearFn = Callable[..., torch.Tensor]


class LoraBatch:
    """A step's adapters: each token's slot [T] (-1: none), the slots present, and, per slot
    present, its tokens' rows (None: every token of the step; found on first use, by the torch
    passes only)."""

    def __init__(self, token_slots: torch.Tensor, present: list[int]) -> None:
        self.token_slots = token_slots
        self.present = present
        self._groups: list[tuple[int, torch.Tensor | None]] | None = None

    @classmethod
    def build(cls, seq_slots: Sequence[int], query_lens: Sequence[int], device: torch.device) -> LoraBatch | None:
        """The batch of a step whose sequences run under `seq_slots` with `query_lens` tokens
        each; None when no sequence has an adapter."""
        if all(s < 0 for s in seq_slots):
            return None
        slots = torch.repeat_interleave(torch.tensor(list(seq_slots), dtype=torch.long),
                                        torch.tensor(list(query_lens), dtype=torch.long))
        return cls(slots.to(device), sorted({s for s in seq_slots if s >= 0}))

    @classmethod
    def of_token_slots(cls, slots: torch.Tensor, device: torch.device) -> LoraBatch | None:
        """The batch whose tokens run under `slots` (host, [T]; -1: none), as a tensor-parallel
        rank receives it."""
        present = sorted(s for s in set(slots.tolist()) if s >= 0)
        return cls(slots.to(device), present) if present else None

    @property
    def groups(self) -> list[tuple[int, torch.Tensor | None]]:
        if self._groups is None:
            slots = self.token_slots
            if len(self.present) == 1 and int(slots.min()) >= 0:
                self._groups = [(self.present[0], None)]
            else:
                self._groups = [(s, (slots == s).nonzero().flatten()) for s in self.present]
        return self._groups


class LoraContext:
    """What every slot holder of one model reads: the number of slots and the step running."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.batch: LoraBatch | None = None


class LoraLinear:
    """A linear layer's adapter slots: y += b_s @ (a_s @ x) for each token under slot s."""

    def __init__(self, context: LoraContext, out_features: int, in_features: int) -> None:
        self.context = context
        self.shape = (out_features, in_features)
        self.pairs: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * context.num_slots
        self._table: cpu_kernel.SlotTable | None = None  # the Rust pass's (lora/cpu_kernel.py), built on use

    def load(self, slot: int, a: torch.Tensor, b: torch.Tensor) -> None:
        self.pairs[slot] = (a.contiguous(), b.contiguous())
        self._table = None

    def clear(self, slot: int) -> None:
        self.pairs[slot] = None
        self._table = None

    def __call__(self, x: torch.Tensor, y: torch.Tensor, linear: LinearFn, threads: int = 1) -> torch.Tensor:
        """y (x's projection by the base weight) plus the step's adapters' low-rank terms: on the
        CPU every token's at once through the Rust kernel (lora/cpu_kernel.py) on up to
        `threads` threads (the backend's --cpu-threads), elsewhere (or where it declines) one
        low-rank pass per slot in the step."""
        batch = self.context.batch
        if batch is None:
            return y
        if x.is_cpu:
            out = cpu_kernel.linear_delta(x, y, self.table(x.dtype), batch.token_slots, threads)
            if out is not None:
                return out
        return self.grouped(x, y, linear)

    def table(self, dtype: torch.dtype) -> cpu_kernel.SlotTable | None:
        """The slot table for the Rust pass: every pair as one expert (None where it cannot read them)."""
        if self._table is None or self._table.dtype != dtype:
            pairs = [None if p is None else ExpertPair(p[0][None], p[1][None]) for p in self.pairs]
            self._table = cpu_kernel.SlotTable.of(pairs, (1, *self.shape), dtype)
        return self._table

    def grouped(self, x: torch.Tensor, y: torch.Tensor, linear: LinearFn) -> torch.Tensor:
        """The torch pass: per slot in the step, its rows' low-rank terms through `linear`."""
        batch = self.context.batch
        for slot, rows in batch.groups:
            pair = self.pairs[slot]
            if pair is None:
                continue
            a, b = pair
            if rows is None:
                y = y + linear(linear(x, a), b)
            else:
                y = y.index_add(0, rows, linear(linear(x.index_select(0, rows), a), b))
        return y


@dataclass(frozen=True)
class ExpertPair:
    """An adapter's pair on a stack of experts: a [E or 1, r, in], b [E or 1, out, r] (an
    expert dimension of 1: shared by every expert, SGLang's shared-outer form)."""

    a: torch.Tensor
    b: torch.Tensor

    def delta(self, rows: torch.Tensor, expert: int, linear: LinearFn) -> torch.Tensor:
        a = self.a[expert if self.a.shape[0] > 1 else 0]
        b = self.b[expert if self.b.shape[0] > 1 else 0]
        return linear(linear(rows, a), b)


class LoraExperts:
    """A MoE layer's routed experts' adapter slots: per slot, a pair on w13 (gate and up rows)
    and one on w2, or None."""

    def __init__(self, context: LoraContext, w13_shape: tuple[int, ...], w2_shape: tuple[int, ...]) -> None:
        self.context = context
        self.shapes = {"w13": tuple(w13_shape), "w2": tuple(w2_shape)}
        self.w13: list[ExpertPair | None] = [None] * context.num_slots
        self.w2: list[ExpertPair | None] = [None] * context.num_slots
        self._tables: tuple | None = None  # the Rust pass's slot tables (lora/cpu_kernel.py), built on use

    def load(self, slot: int, which: str, a: torch.Tensor, b: torch.Tensor) -> None:
        getattr(self, which)[slot] = ExpertPair(a.contiguous(), b.contiguous())
        self._tables = None

    def clear(self, slot: int) -> None:
        self.w13[slot] = self.w2[slot] = None
        self._tables = None

    def active(self) -> bool:
        """Whether a token of the step runs under a slot that adapts these experts."""
        batch = self.context.batch
        return batch is not None and any(self.w13[s] is not None or self.w2[s] is not None for s in batch.present)

    def expert_pass(self, act: Activation, linear: LinearFn, threads: int = 1) -> Callable[..., torch.Tensor]:
        """The expert pass (ops/experts.py's ExpertPass contract) with this step's adapters: on
        the CPU every pair at once through the Rust kernel (lora/cpu_kernel.py), elsewhere
        (or where the kernel declines) the torch loop over (slot, expert) groups. `threads`:
        the CPU kernels' (the backend's --cpu-threads)."""

        def run(x, w13, w2, weights, ids, *, tokens=None, b13=None, b2=None) -> torch.Tensor:
            if ids.numel() and x.is_cpu:
                out = cpu_kernel.expert_pass(x, w13, w2, weights, ids, tokens, b13, b2, act,
                                             self.tables(w13.dtype), self.context.batch.token_slots, threads)
                if out is not None:
                    return out
            return self._run(x, w13, w2, weights, ids, tokens, b13, b2, act, linear)

        return run

    def tables(self, dtype: torch.dtype) -> tuple:
        """The slot tables of w13 and w2 for the Rust pass (None each where it cannot read them)."""
        if self._tables is None or self._tables[0] != dtype:
            self._tables = (dtype, cpu_kernel.SlotTable.of(self.w13, self.shapes["w13"], dtype),
                            cpu_kernel.SlotTable.of(self.w2, self.shapes["w2"], dtype))
        return self._tables[1:]

    def _run(self, x, w13, w2, weights, ids, tokens, b13, b2, act, linear) -> torch.Tensor:
        """Pairs grouped by (slot, expert): each group's rows through the expert's weights plus,
        under an adapter, its low-rank terms; the activation, biases and weighting over all rows
        at once, as the torch expert pass does."""
        if not ids.numel():
            return torch.zeros_like(x)
        grid = tokens is None
        top_k = ids.shape[-1] if grid else 1
        flat_ids, flat_weights = ids.reshape(-1).long(), weights.reshape(-1)
        pair_tokens = torch.arange(x.shape[0], device=x.device).repeat_interleave(top_k) if grid else tokens
        num_experts = w13.shape[0]
        keys = (self.context.batch.token_slots.index_select(0, pair_tokens) + 1) * num_experts + flat_ids
        order = torch.argsort(keys, stable=True)
        token_of_row = pair_tokens.index_select(0, order)
        rows = x.index_select(0, token_of_row)
        spans = _spans(keys.index_select(0, order))
        expert_ids = flat_ids.index_select(0, order)
        h = self._project(rows, w13, self.w13, spans, num_experts, linear)
        if b13 is not None:
            h = h + b13.index_select(0, expert_ids)
        out = self._project(act(h), w2, self.w2, spans, num_experts, linear)
        if b2 is not None:
            out = out + b2.index_select(0, expert_ids)
        out = out * flat_weights.index_select(0, order).to(out.dtype)[:, None]
        return torch.zeros_like(x).index_add_(0, token_of_row, out)

    @staticmethod
    def _project(rows, weight, pairs, spans, num_experts, linear) -> torch.Tensor:
        out = rows.new_empty(rows.shape[0], weight.shape[1])
        for key, begin, end in spans:
            slot, expert = key // num_experts - 1, key % num_experts
            part = rows[begin:end]
            y = linear(part, weight[expert])
            pair = pairs[slot] if slot >= 0 else None
            out[begin:end] = y if pair is None else y + pair.delta(part, expert, linear)
        return out


def _spans(sorted_keys: torch.Tensor) -> list[tuple[int, int, int]]:
    """(key, begin, end) of each run of equal keys (one device sync)."""
    keys, counts = torch.unique_consecutive(sorted_keys, return_counts=True)
    spans, begin = [], 0
    for key, count in zip(keys.tolist(), counts.tolist()):
        spans.append((key, begin, begin + count))
        begin += count
    return spans
