"""A gate on the engine's steps that a test holds, so that a request it pauses, aborts or reads
a stream of is still in flight by construction, however fast the machine decodes.

The test's side is a `StepGate`: a file that says how many more steps the engine may take
("open": any number). The engine's side is `gate_steps`, which wraps `EngineCore.step` of one
engine (in-process tests) or of every engine in a process (tests/gated_serve.py, for a real
`r3srv serve`). A held step takes no step and returns no outputs, after a short sleep: the
engine's loop goes on taking commands (pause, abort, weight updates) while it is held.

    gate = StepGate(tmp_path / "gate")
    gate_steps(engine.core, gate.path)
    with gate.allowing(2):   # the prefill and one decode step, then the engine holds
        ...                  # a request of more than 2 tokens cannot finish here
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TypeVar

from r3srv.engine.core import EngineCore
from r3srv.engine.requests import CoreOutputs

HELD_STEP_SLEEP_S = 0.002
T = TypeVar("T")


class StepGate:
    """The test's side of the gate file."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.open()

    def open(self) -> None:
        """Any number of steps from now on."""
        self._write("open")

    def allow(self, steps: int) -> None:
        """`steps` more steps from now on, then hold (0: hold at once)."""
        self._write(f"{uuid.uuid4().hex} {steps}")  # a new grant, even of the same count

    @contextlib.contextmanager
    def allowing(self, steps: int) -> Iterator[StepGate]:
        """allow(steps) for a with block, then open again (whatever the block raised)."""
        self.allow(steps)
        try:
            yield self
        finally:
            self.open()

    def _write(self, text: str) -> None:
        temporary = self.path.with_name(self.path.name + ".tmp")
        temporary.write_text(text)
        os.replace(temporary, self.path)  # the engine reads the old grant or the new, never half


def gate_steps(target: EngineCore | type[EngineCore], path: Path) -> None:
    """Make `target.step` (one core, or the class: every core of the process) take a step only
    when the gate file at `path` grants one."""
    step = target.step
    seen, left = "open", 0

    def gated_step(*args, **kwargs) -> CoreOutputs:
        nonlocal seen, left
        grant = Path(path).read_text()
        if grant != "open":
            if grant != seen:
                seen, left = grant, int(grant.split()[1])
            if left == 0:
                time.sleep(HELD_STEP_SLEEP_S)
                return CoreOutputs()
            left -= 1
        return step(*args, **kwargs)

    target.step = gated_step


def one_step_per_item(gate: StepGate, items: Iterable[T]) -> Iterator[T]:
    """`items` (a stream's chunks) read while the engine takes one more step per item read, so a
    stream has a chunk per step or so however fast the engine: a chunk that comes from no step
    (a chat stream's first, with the role) lets two steps' tokens share one. Send the request
    inside `with gate.allowing(1):` (its first step), then read it through this."""
    for item in items:
        yield item
        gate.allow(1)
