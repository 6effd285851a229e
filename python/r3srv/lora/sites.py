"""Where an adapter's pairs land in the model, found through the loader's own checkpoint targets
(`model.weight_targets()`): each family's names (per-expert and transformers 5's fused ones), the
view of the stacked parameter a name fills, and the slice of it this rank holds all come from
the place that loads the base weights, so an adapter reaches exactly what its base tensor did.

`attach` gives every projection an adapter may target its slots (models/parallel.py's linear
layers, a MoE layer's router gate and routed experts) when the model is built with LoRA, so the
layers hand them to their backend's ops (a fused op that does not compute them declines at build
time). `bind` turns an adapter into, per slot holder, the pair for one slot: the rank's slice of
each target (a split output: B's rows; a split input: A's columns; split experts: both's
experts), placed at the target's rows in the holder's parameter (q, k and v of one fused
projection stack their ranks, each B at its own rows). Anything that does not fit is an
InvalidRequestError naming the target: a module the model lacks, a layout it cannot adapt, a
shape that is not the base tensor's.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch

from r3srv.errors import ConfigError, InvalidRequestError
from r3srv.lora.adapter import LoraAdapter, LoraPair
from r3srv.lora.slots import LoraContext, LoraExperts, LoraLinear
from r3srv.models.parallel import (
    ColumnParallelLinear,
    ExpertSlice,
    RowParallelLinear,
    checkpoint_shape,
    shard_of,
)


@dataclass
class Site:
    """A holder of slots and the parameter its targets are views of."""

    holder: LoraLinear | LoraExperts
    param: torch.Tensor
    which: str = ""  # "w13" / "w2" for experts


@dataclass
class Bound:
    """An adapter's pieces on one holder: (first expert, first row, a, b) each."""

    site: Site
    pieces: list[tuple[int, int, torch.Tensor, torch.Tensor]] = field(default_factory=list)


def attach(model, num_slots: int) -> LoraContext:
    """Slots on every projection an adapter may target; the model's LoraContext."""
    from r3srv.models.moe import SparseMoeBlock

    context = LoraContext(num_slots)
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            module.lora = LoraLinear(context, *module.weight.shape)
        elif isinstance(module, ExpertSlice):
            if module.state.ep_size > 1 and module.state.ep_dispatch == "all_to_all":
                raise ConfigError("LoRA on routed experts needs --ep-dispatch all_reduce (all_to_all sends rows "
                                  "without their tokens, so without their adapters)")
            module.lora = LoraExperts(context, module.w13.shape, module.w2.shape)
        elif isinstance(module, SparseMoeBlock):
            module.gate_lora = LoraLinear(context, *module.gate.shape)
        names = [n for n in getattr(module, "LORA_WEIGHTS", ()) if getattr(module, n) is not None]
        if names:  # a layer's whole projections held as plain weights (MLA's q_a, kv_a)
            module.lora_weights = {n: LoraLinear(context, *getattr(module, n).shape) for n in names}
    for module in model.modules():  # layers that apply a projection outside the step's token rows
        for name in getattr(module, "LORA_EXCLUDED", ()):
            getattr(module, name).lora = None
    model.lora_context = context
    return context


def sites(model) -> dict[int, Site]:
    """The slot holders by the storage of the parameter their targets view."""
    from r3srv.models.moe import SparseMoeBlock

    found: dict[int, Site] = {}
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and module.lora is not None:
            found[_storage(module.weight)] = Site(module.lora, module.weight)
        elif isinstance(module, ExpertSlice) and module.lora is not None:
            found[_storage(module.w13)] = Site(module.lora, module.w13, "w13")
            found[_storage(module.w2)] = Site(module.lora, module.w2, "w2")
        elif isinstance(module, SparseMoeBlock) and module.gate_lora is not None:
            found[_storage(module.gate)] = Site(module.gate_lora, module.gate)
        for name, holder in getattr(module, "lora_weights", {}).items():
            found[_storage(getattr(module, name))] = Site(holder, getattr(module, name))
    return found


def bind(model, adapter: LoraAdapter, param: str) -> list[Bound]:
    """The adapter's pieces per holder, this rank's slices, checked; InvalidRequestError naming
    `param` and the target for a target the model lacks or a pair that does not fit it."""
    targets = model.weight_targets()
    holders = sites(model)
    bound: dict[int, Bound] = {}
    for name, pair in adapter.pairs.items():
        view = targets.get(name)
        if view is None:
            raise InvalidRequestError(f"the adapter targets {name}, which this model does not have", param=param)
        site = holders.get(_storage(view))
        if site is None or view.stride(-1) != 1:
            raise InvalidRequestError(f"the adapter targets {name}, which this server cannot adapt (not a linear "
                                      "projection or routed experts in their plain layout)", param=param)
        a, b = _rank_slice(name, view, pair, param)
        expert, row = _position(view, site.param)
        bound.setdefault(_storage(view), Bound(site)).pieces.append((expert, row, a, b))
    return list(bound.values())


def load_slot(model, slot: int, adapter: LoraAdapter) -> None:
    """The adapter's pairs (this rank's slices) into slot `slot` of every holder it targets."""
    for bound in bind(model, adapter, "lora_path"):
        a, b = merged(bound, model.device, model.dtype)
        if bound.site.which:
            bound.site.holder.load(slot, bound.site.which, a, b)
        else:
            bound.site.holder.load(slot, a, b)


def clear_slot(model, slot: int) -> None:
    """Slot `slot` of every holder emptied."""
    for site in {id(s.holder): s for s in sites(model).values()}.values():
        site.holder.clear(slot)


def _rank_slice(name: str, view: torch.Tensor, pair: LoraPair, param: str) -> tuple[torch.Tensor, torch.Tensor]:
    """pair's a and b checked against the whole checkpoint tensor, then cut to this rank's slice."""
    whole = checkpoint_shape(view)
    stacked = len(whole) == 3
    a, b = pair.a, pair.b
    if stacked != pair.experts:
        raise InvalidRequestError(f"{name}: a {'per-expert' if pair.experts else 'plain'} pair for a "
                                  f"{len(whole)}-D tensor {whole}", param=param)
    experts_ok = not stacked or all(t.shape[0] in (1, whole[0]) for t in (a, b))
    if b.shape[-2] != whole[-2] or a.shape[-1] != whole[-1] or not experts_ok:
        raise InvalidRequestError(f"{name}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit its "
                                  f"base tensor {tuple(whole)}", param=param)
    last = len(whole) - 1
    for split in shard_of(view):
        if split.dim == last:  # split input columns: A's
            a = _cut(a, a.dim() - 1, split.ranges())
        elif split.dim == last - 1:  # split output rows: B's
            b = _cut(b, b.dim() - 2, split.ranges())
        else:  # split experts (a shared one stays whole)
            a = a if a.shape[0] == 1 else _cut(a, 0, split.ranges())
            b = b if b.shape[0] == 1 else _cut(b, 0, split.ranges())
    return a, b


def _cut(t: torch.Tensor, dim: int, ranges: list[tuple[int, int]]) -> torch.Tensor:
    return torch.cat([t.narrow(dim, start, stop - start) for start, stop in ranges], dim=dim)


def _position(view: torch.Tensor, param: torch.Tensor) -> tuple[int, int]:
    """(first expert, first row) of a view inside its parameter."""
    offset = (view.data_ptr() - param.data_ptr()) // param.element_size()
    if param.dim() == 2:
        return 0, offset // param.stride(0)
    return offset // param.stride(0), (offset % param.stride(0)) // param.stride(1)


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def merged(bound: Bound, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """One holder's pieces as one pair: the ranks stacked (A's rows), each B at its own rows and
    rank columns (zeros elsewhere, which add nothing); per expert for routed experts."""
    param = bound.site.param
    rank = sum(a.shape[-2] for _, _, a, _ in bound.pieces)
    # pieces of one expert (per-expert modules) merge into their expert's rows
    if param.dim() == 2:
        a_all = param.new_zeros(rank, param.shape[1], dtype=torch.float32, device="cpu")
        b_all = param.new_zeros(param.shape[0], rank, dtype=torch.float32, device="cpu")
        col = 0
        for _, row, a, b in bound.pieces:
            r = a.shape[0]
            a_all[col:col + r] = a
            b_all[row:row + b.shape[0], col:col + r] = b
            col += r
        return a_all.to(device, dtype), b_all.to(device, dtype)
    return _merged_experts(bound, param, device, dtype)


def _merged_experts(bound: Bound, param: torch.Tensor, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Routed experts: stacked pieces (every expert) keep a shared side shared while every piece
    shares it; per-expert pieces fill their expert. Ranks are stacked per row range."""
    by_rows: dict[int, list[tuple[int, torch.Tensor, torch.Tensor]]] = defaultdict(list)
    for expert, row, a, b in bound.pieces:
        by_rows[row].append((expert, a, b))
    num_experts, out_rows, inputs = param.shape
    groups = []  # (row, rank, a [E|1, r, in], b [E|1, rows, r])
    for row, pieces in sorted(by_rows.items()):
        if len(pieces) == 1 and pieces[0][1].dim() == 3:  # one stacked piece
            _, a, b = pieces[0]
            groups.append((row, a, b))
            continue
        rank = max(a.shape[-2] for _, a, _ in pieces)
        rows = max(b.shape[-2] for _, _, b in pieces)
        a_all = torch.zeros(num_experts, rank, inputs)
        b_all = torch.zeros(num_experts, rows, rank)
        for expert, a, b in pieces:
            a_all[expert, : a.shape[-2]] = a
            b_all[expert, : b.shape[-2], : b.shape[-1]] = b
        groups.append((row, a_all, b_all))
    if len(groups) == 1 and groups[0][0] == 0 and groups[0][2].shape[-2] == out_rows:
        _, a, b = groups[0]
        return a.to(device, dtype).contiguous(), b.to(device, dtype).contiguous()
    rank = sum(a.shape[-2] for _, a, _ in groups)
    a_shared = all(a.shape[0] == 1 for _, a, _ in groups)
    a_all = torch.zeros(1 if a_shared else num_experts, rank, inputs)
    b_all = torch.zeros(num_experts, out_rows, rank)
    col = 0
    for row, a, b in groups:
        r = a.shape[-2]
        a_all[:, col:col + r] = a
        b_all[:, row:row + b.shape[-2], col:col + r] = b
        col += r
    return a_all.to(device, dtype), b_all.to(device, dtype)
