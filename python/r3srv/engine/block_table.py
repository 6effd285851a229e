"""A sequence's KV block ids: append-only until freed, stored in a growing int32 array.

The model runner copies every running sequence's table into the step's padded table
each step. From a Python list that copy converts element by element, which long
contexts make a large part of a step (docs/benchmarks.md); from this array it is one
memcpy. The block manager only appends, or drops the whole table on free, so no other
mutation is offered.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np


class BlockTable:
    __slots__ = ("_ids", "_len")

    def __init__(self, block_ids=()) -> None:
        ids = np.asarray(block_ids, dtype=np.int32).reshape(-1)
        self._ids = np.empty(max(8, len(ids)), dtype=np.int32)
        self._ids[: len(ids)] = ids
        self._len = len(ids)

    def append(self, block_id: int) -> None:
        if self._len == len(self._ids):
            grown = np.empty(2 * len(self._ids), dtype=np.int32)
            grown[: self._len] = self._ids[: self._len]
            self._ids = grown
        self._ids[self._len] = block_id
        self._len += 1

    @property
    def array(self) -> np.ndarray:
        """The ids as an int32 view (valid until the next append)."""
        return self._ids[: self._len]

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index):
        """An int for an index, a list for a slice (a snapshot, like list slicing)."""
        if isinstance(index, slice):
            return self.array[index].tolist()
        if not -self._len <= index < self._len:
            raise IndexError(f"block table index {index} out of range for {self._len} blocks")
        return int(self._ids[index % self._len])

    def __iter__(self) -> Iterator[int]:
        return iter(self.array.tolist())

    def __reversed__(self) -> Iterator[int]:
        return iter(self.array[::-1].tolist())

    def __eq__(self, other) -> bool:
        if isinstance(other, BlockTable):
            other = other.array
        elif not isinstance(other, (list, tuple, np.ndarray)):
            return NotImplemented
        return len(other) == self._len and bool(np.array_equal(self.array, np.asarray(other)))

    __hash__ = None  # mutable

    def __repr__(self) -> str:
        return f"BlockTable({self.array.tolist()})"
