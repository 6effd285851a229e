"""The model's weights on the CPU in transparent huge pages, advised before the loader first
writes them (r3srv._core.advise_huge_pages; rust/src/huge_pages.rs). A CPU decode step streams
every expert weight it routes to once; in 4 KiB pages each 4 KiB costs a TLB miss and stops the
hardware prefetcher, which does not cross pages (docs/benchmarks.md, "Huge pages for the
weights"). The KV cache stays in small pages: the same advice measured no gain there, and
faulting a pool of a GiB in huge pages took the kernel seconds of compaction at start-up.

Advice only: where the kernel has no huge pages to give (turned off, or no free 2 MiB runs),
the memory is what it would have been. settings.huge_pages (R3SRV_HUGEPAGES=0) turns it off.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from r3srv import settings
from r3srv.kernels.rust_core import rust_kernel

advise_entry = rust_kernel("advise_huge_pages")


def advise(tensors: Iterable[torch.Tensor]) -> int:
    """Marks the memory of each distinct CPU storage among `tensors` for huge pages: its pages
    not written yet come as huge pages when they are. Returns the bytes marked (only whole
    2 MiB pages inside a storage count; 0 with the setting off or without the Rust core)."""
    if advise_entry is None or not settings.current().huge_pages:
        return 0
    seen: set[int] = set()
    marked = 0
    for tensor in tensors:
        if tensor.device.type != "cpu":
            continue
        storage = tensor.untyped_storage()
        address = storage.data_ptr()
        if address and address not in seen:
            seen.add(address)
            marked += advise_entry(address, storage.nbytes())
    return marked


__all__ = ["advise"]
