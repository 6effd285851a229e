"""Faults with requests in flight, against real processes: a tensor-parallel worker failing while
it starts; the second node of `-tp 2 --nnodes 2` killed under a request (a 503 naming the lost
rank, nothing of gloo's); SIGTERM while a weight update waits for the requests in flight; a
checkpoint left behind by a full disk. Every request ends with its tokens and rows or a clean
error, and no KV block is left in use."""

from __future__ import annotations

import errno
import signal
import subprocess
import sys

import httpx
import numpy as np
import pytest
from fault_testing import InFlight, accepting, completion, metric, taken_in, tokens_and_rows, wait_until
from server_fixture import TEST_SERVER_ARGS, RemoteServer, free_port, serve_command
from step_gate import StepGate
from tiny_checkpoints import write_tiny_checkpoint

pytestmark = pytest.mark.slow

# A start-up whose rank-1 worker fails at `where`: the patch is made at import, so the worker
# processes (spawned: they import this script as their main module) carry it too. Test-only;
# nothing of it is in r3srv.
_FAILING_WORKER = """
import sys
import r3srv.engine.multiproc_executor as mx

real = getattr(mx, sys.argv[1])

def failing(*args):
    rank = args[0] if isinstance(args[0], int) else args[1]
    if rank != 0:
        raise RuntimeError("test-only: rank 1 fails in " + sys.argv[1])
    return real(*args)

setattr(mx, sys.argv[1], failing)

if __name__ == "__main__":
    from r3srv import LLM
    from r3srv.engine.multiproc_executor import WorkerError
    try:
        LLM(tensor_parallel_size=2, num_kv_blocks=64, max_model_len=128, device="cpu")
    except WorkerError as exc:
        print("WorkerError:", exc)
        sys.exit(7)
"""


@pytest.mark.parametrize("where", ["init_process_group", "load_shard"], ids=["before the rendezvous", "loading"])
def test_a_worker_failing_at_start_up_fails_the_engine_with_its_error(tmp_path, where):
    script = tmp_path / "failing_worker.py"
    script.write_text(_FAILING_WORKER)
    # a hang (the engine waiting for a rank that never comes) would run into this timeout
    done = subprocess.run([sys.executable, str(script), where], capture_output=True, text=True, timeout=240)
    assert done.returncode == 7, done.stdout + done.stderr
    assert f"test-only: rank 1 fails in {where}" in done.stdout and "r3srv-tp-rank1" in done.stdout


def test_losing_the_second_node_answers_503_naming_the_rank_then_the_server_exits():
    master = free_port()
    nodes = ("-tp", "2", "--nnodes", "2", "--master-port", str(master), "--dtype", "float32",
             "--enable-return-routed-experts")
    node1 = subprocess.Popen(serve_command("--node-rank", "1", *nodes, *TEST_SERVER_ARGS),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with RemoteServer(*nodes, *TEST_SERVER_ARGS) as node0:
            first = tokens_and_rows(completion(node0.url, [1, 2, 3], 4))  # both nodes serve
            assert len(first[0]) == 4
            long = InFlight(completion, node0.url, [4, 5, 6], 3000)
            wait_until(lambda: metric(node0.url, "r3srv_num_requests_running") == 1.0, "the request runs")
            node1.kill()
            answer = long.result()
            assert answer.status_code == 503, answer.text
            error = answer.json()["error"]
            assert "rank 1" in error["message"] and "node 1" in error["message"]
            assert not [w for w in ("gloo", "pair.cc", "Connection reset", "Traceback") if w in answer.text]
            assert node0.proc.wait(timeout=60) == 3  # the engine died: restart the server
            assert "Connection reset" in node0.log or "gloo" in node0.log  # the details stay in the log
    finally:
        node1.kill()
        node1.wait()


@pytest.fixture(scope="module")
def policies(tmp_path_factory):
    root = tmp_path_factory.mktemp("policies")
    return write_tiny_checkpoint(root / "v0", "qwen3_moe", seed=0), write_tiny_checkpoint(root / "v1", "qwen3_moe", seed=1)


def test_sigterm_while_a_weight_update_waits_for_the_requests_in_flight(policies, tmp_path):
    v0, v1 = policies
    gate = StepGate(tmp_path / "gate")
    srv = RemoteServer(str(v0), "--enable-weight-updates", "--enable-return-routed-experts", *TEST_SERVER_ARGS,
                       step_gate=gate)
    try:
        gate.allow(3)  # the prefill and two decode steps: the request stays in flight, however fast the machine
        long = InFlight(completion, srv.url, [1, 2, 3], 400)
        wait_until(lambda: metric(srv.url, "r3srv_num_requests_running") == 1.0, "the request runs")
        # the update waits for the request in flight, a new request waits for the update
        update = InFlight(httpx.post, srv.url + "/update_weights_from_disk", json={"model_path": str(v1)}, timeout=300)
        held = InFlight(completion, srv.url, [7, 8], 2)
        wait_until(lambda: taken_in(srv.port) == 3, "the three requests are in")
        srv.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: not accepting(srv.url), "the server stops taking connections")
        gate.open()
        tokens, rows, reason = tokens_and_rows(long.result())
        assert reason in ("abort", "length") and 0 < len(tokens) <= 400
        # the update, still waiting, is refused rather than run in the stop's grace period (a
        # slow load there was cut unanswered); the request it held starts, and is aborted
        refused = update.result()
        assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"], refused.text
        assert held.result().status_code == 200, held.response.text
        tokens_and_rows(held.response)
        assert srv.proc.wait(timeout=60) == 0
    finally:
        gate.open()
        srv.stop()


def write_until_full(source, target, budget: int) -> None:
    """Copy a checkpoint as a disk with `budget` bytes free would have taken it: every write
    past the budget fails with ENOSPC, leaving the file that was being written cut short."""
    target.mkdir()
    left = budget
    for src in sorted(source.iterdir(), key=lambda p: (p.suffix == ".safetensors", p.name)):
        data = src.read_bytes()
        with open(target / src.name, "wb") as out:
            out.write(data[:left])
        if len(data) > left:
            raise OSError(errno.ENOSPC, "No space left on device")
        left -= len(data)


@pytest.mark.parametrize("share", [0.0, 0.001, 0.5, 0.999], ids=["metadata only", "shard header cut",
                                                                   "half the weights", "last bytes missing"])
def test_a_checkpoint_cut_by_a_full_disk_is_a_400_and_leaves_the_weights(policies, tmp_path, share):
    v0, v1 = policies
    metadata = sum(p.stat().st_size for p in v1.iterdir() if p.suffix != ".safetensors")
    shards = sum(p.stat().st_size for p in v1.iterdir() if p.suffix == ".safetensors")
    cut = tmp_path / "cut"
    with pytest.raises(OSError) as full:
        write_until_full(v1, cut, metadata + int(share * shards))
    assert full.value.errno == errno.ENOSPC
    gate = StepGate(tmp_path / "gate")
    with RemoteServer(str(v0), "--enable-weight-updates", "--enable-return-routed-experts", *TEST_SERVER_ARGS,
                      step_gate=gate) as srv:
        before = tokens_and_rows(completion(srv.url, [9, 8, 7], 6))
        gate.allow(3)  # the prefill and two decode steps: the request stays in flight, however fast the machine
        running = InFlight(completion, srv.url, [1, 2, 3], 200)
        wait_until(lambda: metric(srv.url, "r3srv_num_requests_running") == 1.0, "the request runs")
        update = InFlight(httpx.post, srv.url + "/update_weights_from_disk", json={"model_path": str(cut)}, timeout=300)
        # answered at once (a check before the drain) or taken in to wait for the running request
        wait_until(lambda: not update.is_alive() or taken_in(srv.port) == 2, "the update is in")
        gate.open()
        answer = update.result()
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "model_path", answer.text
        tokens, rows, reason = tokens_and_rows(running.result())
        assert reason == "length" and len(tokens) == 200
        after = tokens_and_rows(completion(srv.url, [9, 8, 7], 6))
        assert after[0] == before[0] and np.array_equal(after[1], before[1])  # the old weights, exactly
        wait_until(lambda: metric(srv.url, "r3srv_kv_blocks_used") == 0.0, "every KV block is free")
    assert srv.returncode == 0, srv.log
