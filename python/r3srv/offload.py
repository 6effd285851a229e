"""Running request preparation off the event loop once it is big enough to stall it.

Tokenizing a long prompt or checking many token ids takes tens of milliseconds
(docs/benchmarks.md): on the event loop, time in which no other client is served. On a
worker thread the loop keeps running (the tokenizer releases the GIL for long texts, and
pure Python work is switched out every few ms). Small inputs stay inline, where a thread
hand-off would cost more than the work.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

OFFLOAD_MIN_SIZE = 8192  # characters or token ids


async def run_sized(size: int, fn: Callable[..., T], /, *args, **kwargs) -> T:
    """`fn(*args, **kwargs)`, on a worker thread when `size` (the input's length) is large."""
    if size < OFFLOAD_MIN_SIZE:
        return fn(*args, **kwargs)
    return await asyncio.to_thread(fn, *args, **kwargs)
