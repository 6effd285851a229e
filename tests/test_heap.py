"""r3srv.heap: the serving process's heap frozen once built (run in a fresh interpreter: freezing
the test process's heap would outlive the test)."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import gc, weakref
from r3srv.heap import freeze_startup_heap

class Node:
    pass

garbage = Node(); garbage.me = garbage  # a cycle only the collector frees
dead = weakref.ref(garbage)
del garbage
kept = [Node() for _ in range(1000)]
assert gc.get_freeze_count() == 0
frozen = freeze_startup_heap()
assert dead() is None, "the garbage before the freeze was frozen with the live objects"
assert frozen == gc.get_freeze_count() >= 1000, frozen
tracked = len(gc.get_objects())
assert tracked < 1000, f"a collection still visits {tracked} objects"
later = Node(); later.me = later  # garbage made after the freeze is still collected
dead = weakref.ref(later)
del later
gc.collect()
assert dead() is None
print(frozen)
"""


def test_freezing_keeps_the_live_objects_and_collects_the_rest():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) >= 1000
