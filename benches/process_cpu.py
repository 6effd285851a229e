"""CPU seconds a server spent, counted from Linux's /proc: the process and every live descendant
(vLLM's API server and its engine-core process; r3srv's one process), all their threads, user
plus system time.

Why beside wall time: on a shared machine a server's wall time measures how much of the cores
the scheduler gave it as much as how much work it did. A server with more runnable threads or
processes (busy-polling ones included) takes a larger share of a loaded machine, so its wall
time shrinks while its CPU seconds show the work it spent. The two ratios side by side tell
speed from share. A descendant that exits between two readings takes its seconds with it (they
go to its parent's children's totals only once it is reaped), so measure servers whose
processes live for the whole run.
"""

from __future__ import annotations

import os
from pathlib import Path

PROC = Path("/proc")
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat_fields(stat: str) -> list[str]:
    """The fields after the command name (which may hold spaces and parentheses)."""
    return stat.rsplit(")", 1)[1].split()


def _processes(proc: Path) -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, user + system clock ticks) of every process readable now."""
    table = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = _stat_fields((entry / "stat").read_text())
        except OSError:  # exited while listed, or not ours to read
            continue
        # after the name: state, ppid, ... utime and stime are the 14th and 15th fields of stat
        table[int(entry.name)] = (int(fields[1]), int(fields[11]) + int(fields[12]))
    return table


def tree_cpu_seconds(pid: int, proc: Path = PROC) -> float:
    """User + system CPU seconds of `pid` and its live descendants so far."""
    table = _processes(proc)
    children: dict[int, list[int]] = {}
    for child, (parent, _) in table.items():
        children.setdefault(parent, []).append(child)
    ticks, todo = 0, [pid]
    while todo:
        p = todo.pop()
        if p in table:
            ticks += table[p][1]
        todo.extend(children.get(p, ()))
    return ticks / _TICKS
