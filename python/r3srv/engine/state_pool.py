"""Entries of a hybrid model's linear-attention state pool (models/gated_deltanet.py).

Entries [0, num_slots) are slots: a running sequence computes in its own. Entries
[num_slots, num_slots + num_snapshots) are snapshots: copies of a sequence's states taken
right after the last token of one of its KV blocks, which is what lets the prefix cache
serve a hybrid model (a prompt that reuses the blocks up to a snapshot restores it into its
slot and computes the rest). Each running sequence owns at most one snapshot, overwritten at
every block boundary it crosses; when the sequence ends it joins an LRU of unowned ones, as
a prompt's snapshot does at once (BlockManager.plan_snapshots), and fresh snapshots evict
the oldest. Which block a snapshot belongs to is the block manager's business (Block.snapshot).
"""

from __future__ import annotations

from collections import OrderedDict


class StatePool:
    def __init__(self, num_slots: int, num_snapshots: int) -> None:
        self.num_slots = num_slots
        self.num_snapshots = num_snapshots
        self._free_slots = list(range(num_slots - 1, -1, -1))
        self._free_snapshots = list(range(num_slots + num_snapshots - 1, num_slots - 1, -1))
        self._unowned: OrderedDict[int, int] = OrderedDict()  # snapshot entry -> its block id, LRU first

    @property
    def num_used_slots(self) -> int:
        return self.num_slots - len(self._free_slots)

    @property
    def num_owned_snapshots(self) -> int:
        """Snapshots held by running sequences."""
        return self.num_snapshots - len(self._free_snapshots) - len(self._unowned)

    @property
    def num_kept_snapshots(self) -> int:
        """Snapshots no sequence owns, kept for prefix hits."""
        return len(self._unowned)

    def take_slot(self) -> int:
        if not self._free_slots:
            raise RuntimeError(f"out of linear-attention state slots: all {self.num_slots} in use")
        return self._free_slots.pop()

    def give_back_slot(self, slot: int) -> None:
        self._free_slots.append(slot)

    def take_snapshot(self) -> tuple[int, int | None] | None:
        """A snapshot entry for a sequence to own: (entry, block id it was evicted from, if any);
        None when every snapshot is owned by a running sequence."""
        if self._free_snapshots:
            return self._free_snapshots.pop(), None
        if self._unowned:
            return self._unowned.popitem(last=False)
        return None

    def disown(self, entry: int, block_id: int | None) -> None:
        """A sequence's snapshot outlives it: kept for prefix hits on `block_id` until evicted
        (None: it belongs to no block, so it is simply free)."""
        if block_id is None:
            self._free_snapshots.append(entry)
        else:
            self._unowned[entry] = block_id

    def touch(self, entry: int) -> None:
        """A prefix hit used an unowned snapshot: evict it last."""
        if entry in self._unowned:
            self._unowned.move_to_end(entry)

    def drop(self, entry: int) -> None:
        """Its block is gone (evicted or forgotten): an unowned snapshot becomes free."""
        if self._unowned.pop(entry, None) is not None:
            self._free_snapshots.append(entry)
