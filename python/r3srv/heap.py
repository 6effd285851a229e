"""A serving process's Python heap, frozen once it is built.

CPython's full (oldest-generation) collection visits every tracked object, and a serving
process holds some 200,000 once torch, the model, the tokenizer and the HTTP layer are loaded:
each full collection then takes tens of milliseconds (docs/benchmarks.md, "A frozen heap"),
holding the GIL, so the engine thread stalls mid-step, every few hundred requests. Those objects
live as long as the process, so `gc.freeze` moves them where no collection looks (vLLM's serving
processes do the same); the requests' own garbage is still collected as before.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collects what is garbage now (so that it is not kept for good), then freezes every
    object left; returns how many the collector no longer visits."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
