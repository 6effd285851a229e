"""`r3srv serve` with its engine's steps behind a test's gate (tests/step_gate.py):

    python tests/gated_serve.py GATE_FILE serve [serve's arguments]

RemoteServer(..., step_gate=GATE_FILE) starts it. The gate file must exist (StepGate writes
"open" when made). With --data-parallel-size, every replica runs gated too (each counts its own
steps against the same grants).
"""

import sys

from step_gate import gate_steps

import r3srv.data_parallel
from r3srv.cli import main
from r3srv.engine.core import EngineCore


def gated_replicas(gate: str) -> None:
    """Each replica's `python -m r3srv.cli serve ...` becomes `python gated_serve.py GATE serve ...`."""
    replica_argv = r3srv.data_parallel.replica_argv

    def gated(*args, **kwargs) -> list[str]:
        argv = replica_argv(*args, **kwargs)
        return [argv[0], __file__, gate, *argv[3:]]

    r3srv.data_parallel.replica_argv = gated


if __name__ == "__main__":
    gate_steps(EngineCore, sys.argv[1])
    gated_replicas(sys.argv[1])
    sys.exit(main(sys.argv[2:]))
