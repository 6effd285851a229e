"""What the recurrent (state-space and linear-attention) layers share: per-sequence states in a
pool of entries, continued step after step (models/gated_deltanet.py: Qwen3-Next and Qwen3.5;
models/mamba2.py: Nemotron-H).

A layer's pool holds slots, one per running sequence (given by the engine), and snapshots,
copies of a sequence's states at a block boundary that a later prompt sharing the prefix
restores into its slot (prefix caching, engine/state_pool.py). A sequence whose step starts
at position 0 starts from zero states, so a slot needs no reset when it changes hands (or
after a preemption). Every such layer has a causal depthwise convolution before its
recurrence: its state is the last `kernel - 1` inputs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class LinearStateBatch:
    """Per-step indices of the linear layers, built once and shared by them."""

    slots: list[int]  # state slot of each sequence
    fresh: list[bool]  # the sequence's step starts at position 0: zero states
    spans: list[tuple[int, int]]  # its rows in the step's T tokens
    decode: bool  # every sequence has one token: one batched recurrent step
    slot_index: torch.Tensor  # [B] slots, on the device
    keep: torch.Tensor  # [B, 1, 1] float: 0 where fresh, to zero a gathered state
    snapshot_at: list[list[tuple[int, int]]]  # per sequence: (tokens into its span, entry) to snapshot
    restore_from: torch.Tensor | None = None  # [R] snapshot entries copied ...
    restore_to: torch.Tensor | None = None  # ... into these slots before the step
    snapshot_from: torch.Tensor | None = None  # decode steps: [S] slots copied after the step ...
    snapshot_to: torch.Tensor | None = None  # ... into these snapshot entries

    @classmethod
    def build(cls, batch, device) -> "LinearStateBatch":
        query_lens, context_lens = batch.query_lens, batch.context_lens
        slots = list(range(len(query_lens))) if batch.state_slots is None else [int(s) for s in batch.state_slots]
        fresh = [ctx == q for q, ctx in zip(query_lens, context_lens)]
        ends = torch.tensor(query_lens).cumsum(0).tolist()
        spans = [(end - q, end) for q, end in zip(query_lens, ends)]
        keep = torch.tensor([0.0 if f else 1.0 for f in fresh], device=device)[:, None, None]
        snapshot_at: list[list[tuple[int, int]]] = [[] for _ in query_lens]
        for i, position, entry in batch.state_snapshots:
            offset = position - (context_lens[i] - query_lens[i])
            if not 0 < offset <= query_lens[i]:
                raise ValueError(f"snapshot position {position} is not inside sequence {i}'s tokens this step")
            snapshot_at[i].append((offset, entry))
        for points in snapshot_at:
            points.sort()
        states = cls(slots, fresh, spans, all(q == 1 for q in query_lens),
                     torch.tensor(slots, dtype=torch.long, device=device), keep, snapshot_at)
        if batch.state_restores:
            entries, targets = zip(*batch.state_restores)
            states.restore_from = torch.tensor(entries, dtype=torch.long, device=device)
            states.restore_to = torch.tensor(targets, dtype=torch.long, device=device)
        if batch.state_snapshots and states.decode:
            states.snapshot_from = torch.tensor([slots[i] for i, _, _ in batch.state_snapshots], device=device)
            states.snapshot_to = torch.tensor([entry for _, _, entry in batch.state_snapshots], device=device)
        return states

    def entries(self) -> list[int]:
        """Every pool entry this step touches (to check them against the pool's size)."""
        snapshots = [entry for points in self.snapshot_at for _, entry in points]
        restores = [] if self.restore_from is None else self.restore_from.tolist()
        return self.slots + snapshots + restores


def restore_snapshots(pools: tuple[torch.Tensor, ...], states: LinearStateBatch) -> None:
    """Prefix hits resume: copy their snapshots into their slots (before any layer writes)."""
    if states.restore_from is not None:
        for pool in pools:
            pool.index_copy_(0, states.restore_to, pool.index_select(0, states.restore_from))


def snapshot_decodes(pools: tuple[torch.Tensor, ...], states: LinearStateBatch) -> None:
    """After a decode step: copy the slots of the decodes that completed a block into their snapshots."""
    if states.snapshot_to is not None:
        for pool in pools:
            pool.index_copy_(0, states.snapshot_to, pool.index_select(0, states.snapshot_from))


def causal_conv(pool: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                states: LinearStateBatch) -> torch.Tensor:
    """SiLU of the causal depthwise convolution of x [T, C] (weight [C, K]) continuing each
    sequence's conv state in `pool` [entries, C, K - 1], which it updates (and snapshots)."""
    kernel = weight.shape[1]
    if states.decode:
        prev = pool.index_select(0, states.slot_index) * states.keep.to(x.dtype)
        window = torch.cat((prev, x[:, :, None]), dim=-1)  # [B, C, K]
        pool.index_copy_(0, states.slot_index, window[:, :, 1:])
        out = (window * weight).sum(-1)
        return F.silu(out if bias is None else out + bias)
    out = torch.empty_like(x)
    for slot, fresh, (lo, hi), points in zip(states.slots, states.fresh, states.spans, states.snapshot_at):
        prev = torch.zeros_like(pool[slot]) if fresh else pool[slot]
        full = torch.cat((prev, x[lo:hi].T), dim=-1)  # [C, K - 1 + n]: inputs from lo - (K - 1)
        out[lo:hi] = F.conv1d(full[None], weight[:, None], bias, groups=x.shape[1])[0].T
        for offset, entry in points:  # the K - 1 inputs before each snapshot's position
            pool[entry] = full[:, offset : offset + kernel - 1]
        pool[slot] = full[:, full.shape[1] - (kernel - 1) :]
    return F.silu(out)


def scan_prefills(pool: torch.Tensor, states: LinearStateBatch, scan: Callable[[torch.Tensor, int, int], None]) -> None:
    """Each sequence's span through `scan(state, lo, hi)` (which continues `state`, a view of its
    slot in `pool`, over rows lo:hi and writes their outputs), from a zero state when fresh,
    split where the step snapshots it."""
    for slot, fresh, (lo, hi), points in zip(states.slots, states.fresh, states.spans, states.snapshot_at):
        s = pool[slot]
        if fresh:
            s.zero_()
        a = lo
        for b, entry in [(lo + offset, entry) for offset, entry in points] + [(hi, None)]:
            if a < b:
                scan(s, a, b)
            if entry is not None:
                pool[entry] = s
            a = b
