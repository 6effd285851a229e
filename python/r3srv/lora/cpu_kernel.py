"""LoRA on the CPU through the Rust core (kernels/pair_projection_cpu.py): the expert pass with
every (token, expert) pair of a step at once, whatever the mix of adapters, in six calls instead
of a torch loop over (slot, expert) groups; and a linear layer's low-rank terms of every token
in two calls instead of two per slot in the step.

Per projection (w13, then w2 on the activation):
    base:   y[p]  = W[e_p] @ x[p]                  (the pairs grouped by expert)
    shrink: s[p]  = A[slot_p, e_p] @ x[p]          (grouped by (slot, expert); rank r_slot)
    expand: y[p] += B[slot_p, e_p] @ s[p][:r_slot]  (the same groups)
punica's shrink and expand (vLLM) over per-pair matrix addresses: each slot's pair keeps its own
rank and its shared side (an expert dimension of 1, SGLang's shared-outer form) stays one
matrix, nothing padded or copied. A pair whose token runs under no adapter, or under one that
leaves this projection as in the base, has no low-rank matrix and keeps its base row. The
activation, biases and weighting run over all rows at once in float32, as the torch pass does.
A linear layer is the case of one expert: its tokens' rows, shrunk and expanded the same way,
added to the base projection y.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from r3srv.kernels import pair_projection_cpu
from r3srv.kernels.rust_core import RUST_DTYPES


@dataclass(frozen=True)
class SlotTable:
    """One projection's adapters, fields [5, slots + 1] by slot + 1 (column 0: no adapter): the
    byte address of A's first expert, the bytes from one expert to the next (0: one matrix shared
    by every expert), the same two of B, and the rank. A slot that leaves this projection as in
    the base is all zeros, so every pair's address, base + expert x step, is 0 under it."""

    fields: torch.Tensor
    max_rank: int
    dtype: torch.dtype
    shape: tuple[int, int, int]  # the weight's [E, out, in], which every pair's matrices fit
    keep: tuple  # the pairs' tensors, alive while their addresses are in the table

    @classmethod
    def of(cls, pairs: list, weight_shape: tuple[int, ...], dtype: torch.dtype) -> SlotTable | None:
        """The table of the slots' pairs (ExpertPair or None each) on a weight of
        `weight_shape` [E, out, in], or None where the kernel cannot read one (another dtype or
        shape, not contiguous, not on the CPU): the kernel reads whole matrices at these
        addresses, so every one is checked here."""
        num_experts, out_rows, in_cols = weight_shape
        size = torch.empty((), dtype=dtype).element_size()
        fields = torch.zeros(5, len(pairs) + 1, dtype=torch.int64)
        for slot, pair in enumerate(pairs):
            if pair is None:
                continue
            for t in (pair.a, pair.b):
                if t.dtype != dtype or not t.is_cpu or not t.is_contiguous():
                    return None
            rank = pair.a.shape[-2]
            if (pair.a.shape[1:] != (rank, in_cols) or pair.b.shape[1:] != (out_rows, rank)
                    or pair.a.shape[0] not in (1, num_experts) or pair.b.shape[0] not in (1, num_experts)):
                return None
            a_step = pair.a[0].numel() * size if pair.a.shape[0] > 1 else 0
            b_step = pair.b[0].numel() * size if pair.b.shape[0] > 1 else 0
            fields[:, slot + 1] = torch.tensor([pair.a.data_ptr(), a_step, pair.b.data_ptr(), b_step, rank])
        keep = tuple(t for pair in pairs if pair is not None for t in (pair.a, pair.b))
        return cls(fields, int(fields[4].max()), dtype, tuple(weight_shape), keep)


def expert_pass(x, w13, w2, weights, ids, tokens, b13, b2, act, tables, token_slots, threads: int = 1) -> torch.Tensor | None:
    """ops/experts.py's expert pass with each pair's adapter (token_slots [T], -1: none; tables:
    SlotTable of w13 and of w2) through the Rust kernel on up to `threads` threads, or None where it does not apply: no
    built kernel, a device other than the CPU, a dtype it does not read, or a table missing."""
    dtype = w13.dtype
    if not pair_projection_cpu.BUILT or dtype not in RUST_DTYPES or not x.is_cpu or None in tables:
        return None
    if w2.dtype != dtype or not w13.is_cpu or not w13.is_contiguous() or not w2.is_contiguous():
        return None
    flat_ids = ids.reshape(-1).long()
    num_experts = w13.shape[0]
    if int(flat_ids.min()) < 0 or int(flat_ids.max()) >= num_experts:  # the addresses stay inside w13 and w2
        return None
    top_k = ids.shape[-1] if tokens is None else 1
    pair_tokens = torch.arange(x.shape[0]).repeat_interleave(top_k) if tokens is None else tokens.long()
    slot_index = token_slots.index_select(0, pair_tokens) + 1
    rows = x.index_select(0, pair_tokens).float().contiguous()
    h = _project(rows, w13, tables[0], flat_ids, slot_index, threads)
    if b13 is not None:
        h += b13.index_select(0, flat_ids).float()
    out = _project(act(h).contiguous(), w2, tables[1], flat_ids, slot_index, threads)
    if b2 is not None:
        out += b2.index_select(0, flat_ids).float()
    out *= weights.reshape(-1, 1).float()
    return torch.zeros(x.shape, dtype=torch.float32).index_add_(0, pair_tokens, out).to(x.dtype)


def _project(rows: torch.Tensor, weight: torch.Tensor, table: SlotTable, ids: torch.Tensor,
             slot_index: torch.Tensor, threads: int) -> torch.Tensor:
    """Each pair's rows through its expert's weight [E, out, in] plus its adapter's B @ A."""
    num_pairs, (out_rows, in_cols) = rows.shape[0], weight.shape[1:]
    out = rows.new_zeros(num_pairs, out_rows)
    full_out, full_in = torch.full((num_pairs,), out_rows), torch.full((num_pairs,), in_cols)
    base = weight.data_ptr() + ids * (out_rows * in_cols * weight.element_size())
    pair_projection_cpu.project_pairs(rows, out, base, full_out, full_in, weight.dtype, threads)
    _add_low_rank(rows, out, table, ids, slot_index, weight.dtype, threads)
    return out


def linear_delta(x: torch.Tensor, y: torch.Tensor, table: SlotTable | None, token_slots: torch.Tensor,
                 threads: int = 1) -> torch.Tensor | None:
    """y (x's base projection [T, out]) plus each token's adapter's B @ A x (table: a linear
    layer's SlotTable, as one expert) on up to `threads` threads, or None where the kernel does
    not apply."""
    if table is None or not pair_projection_cpu.BUILT or x.dtype not in RUST_DTYPES or not x.is_cpu:
        return None
    if x.dim() != 2 or y.dim() != 2 or x.shape[0] != token_slots.shape[0] or y.shape[0] != x.shape[0]:
        return None
    delta = y.new_zeros(y.shape, dtype=torch.float32)
    rows = x.float().contiguous()
    if not _add_low_rank(rows, delta, table, torch.zeros_like(token_slots), token_slots + 1, table.dtype, threads):
        return y
    return y + delta.to(y.dtype)


def _add_low_rank(rows, out, table, ids, slot_index, dtype, threads: int = 1) -> bool:
    """out[p] += B @ (A @ rows[p]) of pair p's (slot, expert) adapter, where it has one, in one
    call (the matrices looked up in the Rust core); whether any pair has one."""
    num_experts, out_rows, in_cols = table.shape
    if not table.max_rank:
        return False
    if rows.shape[1] != in_cols or out.shape[1] != out_rows:  # the matrices' sizes come from the table
        raise ValueError(f"rows of {rows.shape[1]} and outputs of {out.shape[1]} for adapters of {table.shape}")
    return pair_projection_cpu.add_low_rank(rows, out, table.fields, slot_index, ids, num_experts, dtype, threads)
