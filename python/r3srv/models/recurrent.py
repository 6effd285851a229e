"""What the recurrent (state-space and linear-attention) layers share: per-sequence states in a
pool of entries, continued step after step (models/gated_deltanet.py: Qwen3-Next and Qwen3.5;
models/mamba2.py: Nemotron-H and Granite-4.0-H; models/kda.py: Kimi-Linear; models/short_conv.py:
LFM2-MoE, a convolution alone).

A layer's pool holds slots, one per running sequence (given by the engine), and snapshots,
copies of a sequence's states at a block boundary that a later prompt sharing the prefix
restores into its slot (prefix caching, engine/state_pool.py). A sequence whose step starts
at position 0 starts from zero states, so a slot needs no reset when it changes hands (or
after a preemption). Every such layer has a causal depthwise convolution before its
recurrence: its state is the last `kernel - 1` inputs.

A step's sequences are grouped: those computing one token take one batched recurrent step
(on CUDA the backend's fused in-place step, ops/cuda.py); the others are padded to the longest
of their group and scanned together in chunks, one group for lengths that pad within the
backend's `scan_pad_factor` (CUDA: a batch of rollouts' prompts is a few launches per layer,
not a few per sequence; the CPU, where launches cost little and padding costs compute, scans
each multi-token sequence alone: grouping measured slower there, even for equal lengths,
docs/benchmarks.md, benches/bench_hybrid_prefill.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from r3srv.ops import Ops
from r3srv.transfer import to_device


@dataclass
class StepGroup:
    """The sequences computing one token this step: one batched recurrent step."""

    rows: torch.Tensor  # [G] their rows in the step's T tokens
    slots: torch.Tensor  # [G] their state slots
    keep: torch.Tensor  # [G] float: 0 where fresh, to zero a gathered state
    snapshot_slots: torch.Tensor | None = None  # slots of the members whose token completes a block ...
    snapshot_entries: torch.Tensor | None = None  # ... copied after the step into these snapshots


@dataclass
class ScanGroup:
    """Sequences computing several tokens: padded to the longest member and scanned in chunks
    together (padding is neutral: it neither writes nor decays a state)."""

    index: torch.Tensor  # [G, L] rows in the step's T tokens (padding: row 0)
    valid: torch.Tensor  # [G, L] bool: a real token
    lengths: torch.Tensor  # [G] long
    slots: torch.Tensor  # [G]
    keep: torch.Tensor  # [G] float
    captures: list[tuple[int, int, int]]  # (member, tokens into its span, snapshot entry)
    rows: torch.Tensor  # [R] the real rows, member by member (= index[valid])
    # [R] each real row's member and position in the padded group: indexing by a mask would
    # wait for the GPU to count it
    valid_members: torch.Tensor
    valid_positions: torch.Tensor

    def take_valid(self, y: torch.Tensor) -> torch.Tensor:
        """y [G, L, ...] -> its real positions [R, ...], member by member (= y[valid])."""
        return y[self.valid_members, self.valid_positions]

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, ...] -> [G, L, ...], zeros where padded (selected, not multiplied: a non-finite
        value in the row padding reads must not leak in)."""
        valid = self.valid.view(*self.valid.shape, *[1] * (x.dim() - 1))
        return torch.where(valid, x[self.index], torch.zeros((), dtype=x.dtype, device=x.device))


@dataclass
class LinearStateBatch:
    """Per-step indices of the recurrent layers, built once and shared by them."""

    slots: list[int]  # state slot of each sequence
    steps: list[StepGroup]
    scans: list[ScanGroup]
    snapshot_entries: list[int]  # every snapshot this step writes
    restore_entries: list[int] = field(default_factory=list)  # the snapshots restored, on the host
    restore_from: torch.Tensor | None = None  # [R] snapshot entries copied ...
    restore_to: torch.Tensor | None = None  # ... into these slots before the step

    @classmethod
    def build(cls, batch, device, pad_factor: float = 0.0) -> "LinearStateBatch":
        """The step's groups; a scan group pads its members to the longest, at most `pad_factor`
        padded tokens per real one (below 1: every multi-token sequence scans alone)."""
        if batch.graph is not None:  # a graph-captured decode step: one step group from static tensors
            g = batch.graph
            rows = torch.arange(g.state_slots.shape[0], device=g.state_slots.device)
            return cls([], [StepGroup(rows, g.state_slots, g.state_keep)], [], [])
        query_lens, context_lens = batch.query_lens, batch.context_lens
        slots = list(range(len(query_lens))) if batch.state_slots is None else [int(s) for s in batch.state_slots]
        starts = torch.tensor([0] + query_lens).cumsum(0).tolist()
        snapshots: dict[int, list[tuple[int, int]]] = {}
        for i, position, entry in batch.state_snapshots:
            offset = position - (context_lens[i] - query_lens[i])
            if not 0 < offset <= query_lens[i]:
                raise ValueError(f"snapshot position {position} is not inside sequence {i}'s tokens this step")
            snapshots.setdefault(i, []).append((offset, entry))

        def tensor(values, dtype=torch.long):
            return torch.tensor(values, dtype=dtype, device=device)

        steps: list[StepGroup] = []
        singles = [i for i, q in enumerate(query_lens) if q == 1]
        if singles:  # a decode step's indices in one transfer that does not wait for the GPU
            rows, single_slots, kept = to_device(
                [[starts[i] for i in singles], [slots[i] for i in singles],
                 [context_lens[i] != query_lens[i] for i in singles]], torch.device(device))
            group = StepGroup(rows, single_slots, kept.to(torch.float32))
            snapped = [(slots[i], entry) for i in singles for _, entry in snapshots.get(i, [])]
            if snapped:
                group.snapshot_slots, group.snapshot_entries = (tensor(list(v)) for v in zip(*snapped))
            steps.append(group)
        scans = [
            cls._scan_group(members, query_lens, context_lens, starts, slots, snapshots, torch.device(device))
            for members in _scan_groups([i for i, q in enumerate(query_lens) if q > 1], query_lens, pad_factor)
        ]
        states = cls(slots, steps, scans, [entry for points in snapshots.values() for _, entry in points])
        if batch.state_restores:
            entries, targets = zip(*batch.state_restores)
            states.restore_entries = list(entries)
            states.restore_from, states.restore_to = tensor(list(entries)), tensor(list(targets))
        return states

    @staticmethod
    def _scan_group(members, query_lens, context_lens, starts, slots, snapshots, device) -> ScanGroup:
        """Built on the host and sent in one transfer that does not wait for the GPU."""
        lengths = np.array([query_lens[i] for i in members])
        positions = np.arange(lengths.max())
        valid = positions[None, :] < lengths[:, None]
        index = np.where(valid, np.array([starts[i] for i in members])[:, None] + positions[None, :], 0)
        kept = np.array([context_lens[i] != query_lens[i] for i in members])
        lengths_t, index_t, valid_t, slots_t, kept_t, rows, valid_members, valid_positions = to_device(
            [lengths, index, valid, [slots[i] for i in members], kept, index[valid], *np.nonzero(valid)], device)
        captures = [(m, offset, entry) for m, i in enumerate(members) for offset, entry in snapshots.get(i, [])]
        return ScanGroup(index_t, valid_t.bool(), lengths_t, slots_t, kept_t.to(torch.float32), captures, rows,
                         valid_members, valid_positions)

    @property
    def decode(self) -> bool:
        """Every sequence computes one token."""
        return not self.scans

    def entries(self) -> list[int]:
        """Every pool entry this step touches (to check them against the pool's size)."""
        return self.slots + self.snapshot_entries + self.restore_entries


def _scan_groups(members: list[int], query_lens: list[int], factor: float) -> list[list[int]]:
    """Multi-token sequences, longest first, cut so that each group's padded size stays within
    `factor` times its real tokens (below 1: one sequence per group)."""
    groups: list[list[int]] = []
    for i in sorted(members, key=lambda j: -query_lens[j]):
        group = groups[-1] if groups else None
        if group and (len(group) + 1) * query_lens[group[0]] <= factor * (
                sum(query_lens[j] for j in group) + query_lens[i]):
            group.append(i)
        else:
            groups.append([i])
    return groups


def _zeroed(pool: torch.Tensor, slots: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """The slots' states (a copy), zero for fresh sequences."""
    return pool.index_select(0, slots) * keep.view(-1, *[1] * (pool.dim() - 1)).to(pool.dtype)


def restore_snapshots(pools: tuple[torch.Tensor, ...], states: LinearStateBatch) -> None:
    """Prefix hits resume: copy their snapshots into their slots (before any layer writes)."""
    if states.restore_from is not None:
        for pool in pools:
            pool.index_copy_(0, states.restore_to, pool.index_select(0, states.restore_from))


def snapshot_steps(pools: tuple[torch.Tensor, ...], states: LinearStateBatch) -> None:
    """After the step: copy the slots of the one-token sequences that completed a block into
    their snapshots (scanned sequences snapshot inside the scan)."""
    for group in states.steps:
        if group.snapshot_slots is not None:
            for pool in pools:
                pool.index_copy_(0, group.snapshot_entries, pool.index_select(0, group.snapshot_slots))


def causal_conv(pool: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                states: LinearStateBatch, silu: bool = True) -> torch.Tensor:
    """The causal depthwise convolution of x [T, C] (weight [C, K]), through SiLU unless told
    not, continuing each sequence's conv state in `pool` [entries, C, K - 1], which it updates
    (and snapshots, for scanned sequences)."""
    kernel = weight.shape[1]
    out = torch.empty_like(x)
    for group in states.steps:
        window = torch.cat((_zeroed(pool, group.slots, group.keep), x[group.rows][:, :, None]), dim=-1)  # [G, C, K]
        pool.index_copy_(0, group.slots, window[:, :, 1:])
        out[group.rows] = (window * weight).sum(-1) + (0 if bias is None else bias)
    for group in states.scans:
        # [G, C, K - 1 + L]: column j holds the input K - 1 - j positions before the span
        full = torch.cat((_zeroed(pool, group.slots, group.keep), group.pad(x).transpose(1, 2)), dim=-1)
        y = F.conv1d(full, weight[:, None], bias, groups=x.shape[1])  # [G, C, L]
        out[group.rows] = group.take_valid(y.transpose(1, 2))
        for member, offset, entry in group.captures:  # the K - 1 inputs before each snapshot
            pool[entry] = full[member, :, offset : offset + kernel - 1]
        last = group.lengths[:, None] + torch.arange(kernel - 1, device=x.device)  # each span's last K - 1 inputs
        pool.index_copy_(0, group.slots, full.gather(2, last[:, None, :].expand(-1, full.shape[1], -1)))
    return F.silu(out) if silu else out


def run_recurrence(pool: torch.Tensor, states: LinearStateBatch, out: torch.Tensor,
                   step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                   scan: Callable[[torch.Tensor, ScanGroup, list], torch.Tensor],
                   fused_step: Callable[[torch.Tensor, StepGroup], torch.Tensor] | None = None) -> None:
    """Continue every sequence's recurrent state in `pool`, writing out [T, ...]:
    `step(states [G, ...], rows)` for one-token sequences (updates the states in place, returns
    their outputs); `scan(states, group, captures)` for a scan group (continues the states over
    the padded group, copies the state at each capture (member, position, target) into the
    target, returns the outputs [G, L, ...]). `fused_step(pool, group)`, if given, takes the
    one-token sequences instead, updating their states where they lie."""
    for group in states.steps:
        if fused_step is not None:
            out[group.rows] = fused_step(pool, group)
            continue
        s = _zeroed(pool, group.slots, group.keep)
        out[group.rows] = step(s, group.rows)
        pool.index_copy_(0, group.slots, s)
    for group in states.scans:
        s = _zeroed(pool, group.slots, group.keep)
        captures = [(member, offset, pool[entry]) for member, offset, entry in group.captures]
        out[group.rows] = group.take_valid(scan(s, group, captures))
        pool.index_copy_(0, group.slots, s)


def linear_targets(prefix: str, layers: dict[str, tuple[torch.Tensor, torch.Tensor | None]]) -> dict[str, torch.Tensor]:
    """Checkpoint names of a layer's projections and convolution: {name: (weight, bias or None)}."""
    targets = {}
    for name, (weight, bias) in layers.items():
        targets[prefix + name + ".weight"] = weight
        if bias is not None:
            targets[prefix + name + ".bias"] = bias
    return targets


class RecurrentLayer(nn.Module):
    """A layer whose memory of a sequence is a conv window and (but for a short convolution) a
    float32 recurrent state, one of each per pool entry; subclasses give their shapes and their
    step and scan."""

    conv_state: torch.Tensor | None = None  # [entries, channels, kernel - 1], model dtype
    recurrent_state: torch.Tensor | None = None  # [entries, ...], float32
    FUSED_STEP: str | None = None  # the name of the backend's fused decode step this layer's recurrence takes
    fused_step: Callable | None = None  # that step, where the backend has one (bound by use_ops)

    def use_ops(self, ops: Ops) -> None:
        self.fused_step = None if self.FUSED_STEP is None else ops.recurrent_step(self.FUSED_STEP)

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
        """(conv window, recurrent state or None) of one entry."""
        raise NotImplementedError

    def allocate_states(self, num_entries: int, dtype: torch.dtype, device: torch.device) -> None:
        conv, recurrent = self.state_shapes()
        self.conv_state = torch.zeros(num_entries, *conv, dtype=dtype, device=device)
        if recurrent is not None:
            self.recurrent_state = torch.zeros(num_entries, *recurrent, dtype=torch.float32, device=device)

    def free_states(self) -> None:
        self.conv_state = self.recurrent_state = None

    @property
    def has_states(self) -> bool:
        return self.conv_state is not None

    def pools(self) -> tuple[torch.Tensor, ...]:
        return (self.conv_state,) if self.recurrent_state is None else (self.conv_state, self.recurrent_state)

    def begin_step(self, states: LinearStateBatch) -> None:
        """Before a step's first write: the pool exists, prefix hits are restored."""
        if self.conv_state is None:
            raise RuntimeError("init_kv_cache must be called before forward (it allocates the recurrent states)")
        restore_snapshots(self.pools(), states)

    def recur(self, states: LinearStateBatch, out: torch.Tensor, step, scan, inputs=(), arguments=()) -> None:
        """run_recurrence on this layer's states, then the one-token sequences' snapshots. Where
        the backend has a fused step for this layer (`fused_step`, ops/cuda.py), the one-token
        sequences take it in place: `fused_step(pool, slots, keep, *their rows of inputs [T, ...],
        *arguments)`."""
        kernel = self.fused_step

        def fused_step(pool, group):
            return kernel(pool, group.slots, group.keep, *(x[group.rows] for x in inputs), *arguments)

        run_recurrence(self.recurrent_state, states, out, step, scan, fused_step if kernel is not None else None)
        snapshot_steps(self.pools(), states)
