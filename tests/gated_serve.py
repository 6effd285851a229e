"""`r3srv serve` with its engine's steps behind a test's gate (tests/step_gate.py):

    python tests/gated_serve.py GATE_FILE serve [serve's arguments]

RemoteServer(..., step_gate=GATE_FILE) starts it. The gate file must exist (StepGate writes
"open" when made). With --data-parallel-size, every replica runs gated too (each counts its own
steps against the same grants).

With R3SRV_TEST_HOLD_OFFLOADED=PATH in its environment, work big enough for r3srv.offload to hand
to a worker thread (a long prompt's tokenization) also waits while the file PATH exists, after
creating PATH.entered: a test holds it in flight that way, however fast the machine tokenizes.
"""

import os
import sys
import time
from pathlib import Path

from step_gate import HELD_STEP_SLEEP_S, gate_steps

import r3srv.data_parallel
import r3srv.offload
from r3srv.cli import main
from r3srv.engine.core import EngineCore


def gated_replicas(gate: str) -> None:
    """Each replica's `python -m r3srv.cli serve ...` becomes `python gated_serve.py GATE serve ...`."""
    replica_argv = r3srv.data_parallel.replica_argv

    def gated(*args, **kwargs) -> list[str]:
        argv = replica_argv(*args, **kwargs)
        return [argv[0], __file__, gate, *argv[3:]]

    r3srv.data_parallel.replica_argv = gated


def hold_offloaded_work(hold: Path) -> None:
    """r3srv.offload.run_sized's big work waits while `hold` exists. Only the work is wrapped: where
    it runs (a worker thread, or inline on the event loop) is still run_sized's own choice."""
    run_sized = r3srv.offload.run_sized

    def held(fn):
        def wait_then_run(*args, **kwargs):
            hold.with_name(hold.name + ".entered").touch()
            while hold.exists():
                time.sleep(HELD_STEP_SLEEP_S)
            return fn(*args, **kwargs)
        return wait_then_run

    async def held_run_sized(size, fn, /, *args, **kwargs):
        if size >= r3srv.offload.OFFLOAD_MIN_SIZE:
            fn = held(fn)
        return await run_sized(size, fn, *args, **kwargs)

    r3srv.offload.run_sized = held_run_sized  # before the routes import it (main() imports them)


if __name__ == "__main__":
    if os.environ.get("R3SRV_TEST_HOLD_OFFLOADED"):
        hold_offloaded_work(Path(os.environ["R3SRV_TEST_HOLD_OFFLOADED"]))
    gate_steps(EngineCore, sys.argv[1])
    gated_replicas(sys.argv[1])
    sys.exit(main(sys.argv[2:]))
