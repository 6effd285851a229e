"""benches/process_cpu.py: a server's CPU seconds are its own and its live descendants' (the
bench compares vLLM's two processes with r3srv's one), read from /proc."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from process_cpu import tree_cpu_seconds

TICKS = os.sysconf("SC_CLK_TCK")


def _stat(pid: int, name: str, ppid: int, utime: int, stime: int) -> str:
    # proc(5): pid (comm) state ppid pgrp session tty_nr tpgid flags minflt cminflt majflt cmajflt utime stime ...
    return f"{pid} ({name}) S {ppid} {pid} {pid} 0 -1 4194304 10 0 0 0 {utime} {stime} 0 0 20 0 1 0 5\n"


def test_sums_a_process_and_its_descendants_only(tmp_path):
    """A fake /proc: the tree of 10 (children 11 and 12, grandchild 13) against an unrelated
    process and a parent; command names with spaces and parentheses, as /proc prints them."""
    rng = np.random.default_rng(0)
    table = {1: (0, "init"), 10: (1, "vllm serve"), 11: (10, "VLLM::EngineCore"), 12: (10, "a) (b"),
             13: (11, "python3 (x)"), 20: (1, "other")}
    ticks = {pid: rng.integers(1, 10_000, 2) for pid in table}
    for pid, (ppid, name) in table.items():
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(_stat(pid, name, ppid, *ticks[pid]))
    (tmp_path / "self").mkdir()  # non-numeric entries are skipped
    (tmp_path / "14").mkdir()  # a process gone between listing and reading is skipped
    expected = sum(int(ticks[p].sum()) for p in (10, 11, 12, 13)) / TICKS
    assert tree_cpu_seconds(10, tmp_path) == pytest.approx(expected)
    assert tree_cpu_seconds(13, tmp_path) == pytest.approx(int(ticks[13].sum()) / TICKS)
    assert tree_cpu_seconds(99, tmp_path) == 0.0


@pytest.mark.slow
def test_counts_a_grandchilds_work_while_it_lives():
    """A parent that only waits, its child spending CPU until it has used 0.5 s (by its own
    clock, not the wall's) and then waiting too: the tree holds the child's seconds, which the
    parent's own (from its /proc stat) do not."""
    child = textwrap.dedent("""
        import sys, time
        x = 0
        while time.process_time() < 0.5:
            x += sum(range(1000))
        print(time.process_time(), flush=True)
        sys.stdin.readline()
    """)
    parent = subprocess.Popen(
        [sys.executable, "-c", f"import subprocess, sys; subprocess.run([sys.executable, '-c', {child!r}])"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        spent = float(parent.stdout.readline())
        tree = tree_cpu_seconds(parent.pid)
        fields = open(f"/proc/{parent.pid}/stat").read().rsplit(")", 1)[1].split()
        parent_alone = (int(fields[11]) + int(fields[12])) / TICKS
    finally:
        parent.stdin.close()
        parent.wait(timeout=60)
    assert spent >= 0.5 > parent_alone
    assert tree >= parent_alone + spent - 2 / TICKS  # the child's ticks count (to the clock's resolution)
