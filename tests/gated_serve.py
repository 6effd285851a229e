"""`r3srv serve` with its engine's steps behind a test's gate (tests/step_gate.py):

    python tests/gated_serve.py GATE_FILE serve [serve's arguments]

RemoteServer(..., step_gate=GATE_FILE) starts it. The gate file must exist (StepGate writes
"open" when made).
"""

import sys

from step_gate import gate_steps

from r3srv.cli import main
from r3srv.engine.core import EngineCore

if __name__ == "__main__":
    gate_steps(EngineCore, sys.argv[1])
    sys.exit(main(sys.argv[2:]))
