"""Whether a call releases the GIL: the encoders' and decoders' large-input tests."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def assert_releases_gil(call: Callable[[], T]) -> T:
    """Runs `call` up to 20 times; returns its last result.

    A second thread counts only while the main thread is inside the call, and hands the GIL
    straight back (sleep(0)). With a switch interval far longer than the test, a call that
    holds the GIL leaves it no chance to run; one that releases it does whenever the OS gives
    the spinner a core in time, which a loaded 2-core CI machine may not: so 3 of the calls
    must see it advance.
    """
    inside = [False]
    seen = [0]
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            if inside[0]:
                seen[0] += 1
            time.sleep(0)

    old = sys.getswitchinterval()
    sys.setswitchinterval(5.0)
    t = threading.Thread(target=spin)
    t.start()
    advanced = 0
    try:
        for _ in range(20):
            before = seen[0]
            inside[0] = True
            result = call()
            inside[0] = False
            advanced += seen[0] > before
            if advanced >= 3:
                break
    finally:
        stop.set()
        t.join()
        sys.setswitchinterval(old)
    assert advanced >= 3, f"the spinner advanced during {advanced} of the calls"
    return result
