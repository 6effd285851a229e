"""Rows each projected by its own matrix, in one call into the Rust core
(rust/src/pair_projection.rs): out[p][:rows[p]] += M_p @ x[p][:cols[p]], where M_p is the
row-major [rows[p], cols[p]] matrix at address mats[p] (0: none, the row is left as it is).
Pairs that share a matrix run together, reading it once, so a step's (token, expert) pairs and
their adapters' low-rank terms cost one call each however many (slot, expert) groups there are
(r3srv.lora.cpu_kernel builds the address tables). `add_low_rank`: the adapters' shrink and
expand of every pair in one call, each pair's matrices looked up in Rust from its slot's column
of a slot table and its expert. Matrices hold float32 or bfloat16; x and out are float32. The
caller vouches for the addresses: each must point into a live contiguous tensor of `dtype`
holding the matrix.
"""

from __future__ import annotations

import torch

from r3srv.kernels.rust_core import RUST_DTYPES, rust_kernel

project_pairs_entry = rust_kernel("project_pairs_cpu")
add_low_rank_entry = rust_kernel("add_low_rank_cpu")
BUILT = project_pairs_entry is not None and add_low_rank_entry is not None  # else the torch loop (kernels/rust_core.py)


def project_pairs(x: torch.Tensor, out: torch.Tensor, mats: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor,
                  dtype: torch.dtype, threads: int = 1) -> None:
    """out += each pair's matrix times its row of x, in place (see the module docstring): x
    [P, x_cols] and out [P, out_cols] contiguous float32 CPU tensors, mats, rows and cols int64
    [P], the matrices of `dtype`; on up to `threads` threads (a group of pairs sharing a matrix
    runs on one, so the count changes no bit)."""
    for name, t in (("x", x), ("out", out)):
        if t.dtype != torch.float32 or not t.is_cpu or not t.is_contiguous() or t.dim() != 2:
            raise ValueError(f"{name} must be a contiguous 2-d float32 CPU tensor")
    if x.shape[0] != out.shape[0]:
        raise ValueError(f"x has {x.shape[0]} rows and out {out.shape[0]}")
    tables = [t.to(torch.int64).contiguous() for t in (mats, rows, cols)]
    if any(t.shape != (x.shape[0],) for t in tables):
        raise ValueError("mats, rows and cols must hold one value per row of x")
    if not x.shape[0]:
        return
    addresses = (x.data_ptr(), out.data_ptr(), *(t.data_ptr() for t in tables))
    project_pairs_entry(addresses, (x.shape[0], x.shape[1], out.shape[1]), RUST_DTYPES[dtype], threads)


def add_low_rank(x: torch.Tensor, out: torch.Tensor, fields: torch.Tensor, pair_slots: torch.Tensor,
                 pair_experts: torch.Tensor, num_experts: int, dtype: torch.dtype, threads: int = 1) -> bool:
    """out[p] += B @ (A @ x[p]) for each pair p, in place, of the adapter in column pair_slots[p]
    of the slot table `fields` (int64 [5, columns]: A's address, A's byte step per expert, B's
    address, B's byte step, the rank; r3srv.lora.cpu_kernel.SlotTable, which keeps the
    matrices alive and checked: A [rank, x_cols] and B [out_cols, rank] of `dtype`, for each of
    `num_experts` experts or one shared at a step of 0) and of expert pair_experts[p]. x
    [P, x_cols] and out [P, out_cols] contiguous float32 CPU tensors; pair_slots and
    pair_experts int64 [P]. Whether any pair had an adapter."""
    for name, t in (("x", x), ("out", out)):
        if t.dtype != torch.float32 or not t.is_cpu or not t.is_contiguous() or t.dim() != 2:
            raise ValueError(f"{name} must be a contiguous 2-d float32 CPU tensor")
    if x.shape[0] != out.shape[0]:
        raise ValueError(f"x has {x.shape[0]} rows and out {out.shape[0]}")
    if fields.dtype != torch.int64 or fields.dim() != 2 or fields.shape[0] != 5 or not fields.is_contiguous():
        raise ValueError("fields must be a contiguous int64 [5, columns] table")
    pairs = [t.to(torch.int64).contiguous() for t in (pair_slots, pair_experts)]
    if any(t.shape != (x.shape[0],) for t in pairs):
        raise ValueError("pair_slots and pair_experts must hold one value per row of x")
    if not x.shape[0]:
        return False
    addresses = (x.data_ptr(), out.data_ptr(), fields.data_ptr(), *(t.data_ptr() for t in pairs))
    shape = (x.shape[0], x.shape[1], out.shape[1], fields.shape[1], num_experts)
    return add_low_rank_entry(addresses, shape, RUST_DTYPES[dtype], threads)
