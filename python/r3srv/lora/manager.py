"""The adapters an engine serves: registered by name, held on the host up to `max_cpu_loras`,
resident in the model's `max_loras` slots while sequences run under them.

- Registering (`load`) reads and checks the adapter against the model at once (an unknown
  target, a rank above `max_lora_rank`, a shape that does not fit, a corrupt file: an
  InvalidRequestError naming the field; a previous adapter of that name is kept), then keeps it
  on the host. Loading a name again replaces it: its version goes up, a resident copy is dropped
  from its slot, and the caller drops its prefix-cache blocks.
- Host memory: beyond `max_cpu_loras` adapters, the least recently used one read from a
  directory gives back its tensors and is read again when next used (pushed adapters, which
  have no directory, stay).
- Slots: a step's adapters must be resident (`assign`); an adapter not resident takes a free
  slot or the least recently used slot no running sequence holds (the scheduler admits at most
  `max_loras` adapters among the running sequences, so one is always there).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from r3srv.errors import InvalidRequestError
from r3srv.lora import adapter as adapters
from r3srv.lora import sites
from r3srv.lora.adapter import LoraAdapter


@dataclass(frozen=True)
class LoraRef:
    """What a request runs under: the adapter's name, its id and the version it had then."""

    name: str
    id: int
    version: int

    @property
    def cache_key(self) -> tuple:
        """The adapter's part of a prefix-cache block's extra keys."""
        return ("lora", self.id, self.version)


@dataclass
class _Entry:
    name: str
    id: int
    path: str | None
    adapter: LoraAdapter | None
    version: int = 1
    slot: int = -1  # resident in this slot (-1: not)
    pinned: bool = False


class LoraManager:
    def __init__(self, model, *, max_loras: int, max_lora_rank: int, max_cpu_loras: int) -> None:
        self.model = model
        self.max_loras, self.max_lora_rank, self.max_cpu_loras = max_loras, max_lora_rank, max_cpu_loras
        self.entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self.slots: list[str | None] = [None] * max_loras
        self._slot_use: OrderedDict[int, None] = OrderedDict.fromkeys(range(max_loras))  # LRU slots first
        self._ids = itertools.count(1)

    # -- registry ----------------------------------------------------------------------------
    def names(self) -> list[str]:
        return list(self.entries)

    def ref(self, name: str) -> LoraRef:
        entry = self.entries.get(name)
        if entry is None:
            raise InvalidRequestError(f"no LoRA adapter named {name!r} is loaded; loaded: {sorted(self.entries)}",
                                      param="lora_name")
        return LoraRef(name, entry.id, entry.version)

    def load(self, name: str, path: str | None = None, adapter: LoraAdapter | None = None,
             pinned: bool = False) -> LoraRef:
        """Register `name` (from `path`, or an adapter built from pushed tensors), checked against
        the model; a name loaded before is replaced. Returns the new reference."""
        if not isinstance(name, str) or not name:
            raise InvalidRequestError("lora_name must be a non-empty string", param="lora_name")
        if adapter is None:
            adapter = adapters.read_dir(path)
        self.check(adapter, "lora_path" if path is not None else "serialized_named_tensors")
        old = self.entries.pop(name, None)
        if old is not None:
            self._evict_slot(old)
            entry = _Entry(name, old.id, path, adapter, old.version + 1, pinned=pinned)
        else:
            entry = _Entry(name, next(self._ids), path, adapter, pinned=pinned)
        self.entries[name] = entry
        self._trim_host()
        return LoraRef(name, entry.id, entry.version)

    def check(self, adapter: LoraAdapter, param: str) -> None:
        if adapter.rank > self.max_lora_rank:
            raise InvalidRequestError(f"the adapter's rank {adapter.rank} exceeds --max-lora-rank "
                                      f"{self.max_lora_rank}", param=param)
        self.model.check_lora(adapter, param)  # raises for a target or shape that does not fit

    def unload(self, name: str) -> LoraRef:
        entry = self.entries.pop(name, None)
        if entry is None:
            raise InvalidRequestError(f"no LoRA adapter named {name!r} is loaded", param="lora_name")
        self._evict_slot(entry)
        return LoraRef(name, entry.id, entry.version)

    def _trim_host(self) -> None:
        """Host tensors of at most max_cpu_loras adapters: the least recently used ones read from a
        directory give theirs back (read again when used)."""
        held = [e for e in self.entries.values() if e.adapter is not None]
        for entry in held[: max(0, len(held) - self.max_cpu_loras)]:
            if entry.path is not None and entry.slot < 0:
                entry.adapter = None

    # -- slots ---------------------------------------------------------------------------------
    def assign(self, seqs: Iterable, in_flight: Iterable = (), wait: Callable[[], None] | None = None) -> None:
        """Make every adapter the sequences run under resident and set each one's `lora_slot`.
        Overlapped scheduling: `in_flight` are the sequences of the step still running on the
        device; their adapters' slots are not rewritten under it, and when no other slot is free,
        `wait()` lets that step finish first."""
        wanted = {seq.lora.name for seq in seqs if seq.lora is not None}
        busy = {seq.lora.name for seq in in_flight if seq.lora is not None}
        for seq in seqs:
            ref = seq.lora
            if ref is None:
                seq.lora_slot = -1
                continue
            entry = self.entries.get(ref.name)
            if entry is None or entry.version != ref.version:
                raise InvalidRequestError(f"LoRA adapter {ref.name!r} (version {ref.version}) was unloaded or "
                                          "replaced while a request ran under it", param="lora_name")
            if entry.slot < 0:
                if busy and wait is not None and self._free_slot(wanted | busy) is None:
                    wait()
                    busy = set()
                self._make_resident(entry, wanted | busy)
            self._slot_use.move_to_end(entry.slot)
            self.entries.move_to_end(entry.name)
            seq.lora_slot = entry.slot

    def _free_slot(self, keep: set[str]) -> int | None:
        """The least recently used slot holding no adapter of `keep`."""
        return next((s for s in self._slot_use if self.slots[s] is None or self.slots[s] not in keep), None)

    def _make_resident(self, entry: _Entry, keep: set[str]) -> None:
        slot = self._free_slot(keep)
        if slot is None:
            raise RuntimeError("more adapters in one step than --max-loras slots (the scheduler bounds this)")
        if self.slots[slot] is not None:
            self._evict_slot(self.entries[self.slots[slot]])
        if entry.adapter is None:  # its host copy was given back: read it again
            entry.adapter = adapters.read_dir(entry.path)
        self.model.load_lora_slot(slot, entry.adapter)  # (tensor parallelism: on every rank)
        self.slots[slot], entry.slot = entry.name, slot
        self._trim_host()

    def _evict_slot(self, entry: _Entry) -> None:
        if entry.slot < 0:
            return
        self.model.clear_lora_slot(entry.slot)
        self.slots[entry.slot], entry.slot = None, -1

    def resident(self) -> dict[str, int]:
        return {name: slot for slot, name in enumerate(self.slots) if name is not None}


def adapter_from_tensors(config: dict, tensors: dict[str, torch.Tensor]) -> LoraAdapter:
    """A pushed adapter (PEFT's config and its tensors), checked as a saved one is."""
    return adapters.from_tensors(config, tensors, param="serialized_named_tensors")
