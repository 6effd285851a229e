"""The host's free memory: what the CPU's KV cache budget and the packed experts' copy are
sized against."""

from __future__ import annotations

import os


def available_bytes() -> int:
    """Bytes the host can give without swapping: MemAvailable where /proc/meminfo has it, else
    the free pages' bytes."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
