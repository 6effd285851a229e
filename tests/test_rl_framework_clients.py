"""SkyRL's and AReaL's own client code against r3srv, served as docs/rl.md's recipes say, once alone
and once as a 2-replica fleet behind its one URL (the fleet's front is the router SkyRL's proxy_url
names and the one address AReaL's round-robin is given).

The clients (skyrl 0.4.0's RemoteInferenceClient, areal 1.0.4's RemoteSGLangEngine) run in their
own venv (tools/rl_clients_env.sh builds .rl_clients_venv; `make test` does) as a subprocess
(tests/rl_clients_driver.py), which writes what each client handed back:

- AReaL: greedy rollouts through `agenerate` (a second turn on the same rid), `pause_generation` /
  `continue_generation`, its default weight update (xccl: its group init with `master_port` as a
  string, one bucket of `/update_weights_from_distributed` broadcast over gloo, AReaL's backend on
  a host without accelerators) to a second checkpoint, then its disk update back to the first.
- SkyRL: a batch on /skyrl/v1/generate with routed experts on (SkyRL's sampling params and cache
  salt), a second turn with `routed_experts_prompt_starts`, `get_world_size`, keep-mode pause and
  resume, sleep and wake by tags, prefix-cache reset.

Oracle: transformers on each sequence's token ids, with the weights the server held at the time:
every row the client decoded equals the router's top-k there, every sampled token's logprob is
transformers' log-softmax.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from urllib.parse import urlparse

import httpx
import numpy as np
import pytest

from server_fixture import TEST_SERVER_ARGS, RemoteServer
from tiny_checkpoints import build_hf_model, hf_logprobs_and_rows, write_tiny_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.peer]  # real servers, subprocesses, a transformers oracle

ROOT = Path(__file__).resolve().parent.parent
CLIENTS_PYTHON = ROOT / ".rl_clients_venv" / "bin" / "python"
DRIVER = Path(__file__).parent / "rl_clients_driver.py"
SEEDS = {"first": 3, "second": 4}
MODEL = "policy"
# docs/rl.md's SkyRL recipe (its flags are a superset of AReaL's)
FLAGS = ("--enable-return-routed-experts", "--enable-weight-updates", "--enable-collective-rpc",
         "--enable-sleep-mode")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("rl_clients")
    return {name: write_tiny_checkpoint(root / name, seed=seed) for name, seed in SEEDS.items()}


@pytest.fixture(scope="module")
def hf():
    return {name: build_hf_model("qwen3_moe", seed=seed) for name, seed in SEEDS.items()}


@pytest.fixture(scope="module", params=[1, 2], ids=["server", "fleet"])
def server(request, checkpoints):
    if not CLIENTS_PYTHON.exists():
        pytest.skip("no SkyRL/AReaL environment at .rl_clients_venv: tools/rl_clients_env.sh creates it "
                    "(make test does)")
    topology = ("--data-parallel-size", str(request.param)) if request.param > 1 else ()
    with RemoteServer(str(checkpoints["first"]), "--served-model-name", MODEL, *FLAGS, *topology,
                      *TEST_SERVER_ARGS) as srv:
        srv.replicas = request.param
        yield srv
    assert srv.returncode == 0, srv.log


def drive(server, tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "out.json"
    proc = subprocess.run([str(CLIENTS_PYTHON), str(DRIVER), *args, str(out)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:] + "\nserver log:\n" + server.log[-3000:]
    return json.loads(out.read_text(encoding="utf-8"))


def assert_matches_transformers(hf_model, prompt: list[int], output: list[int], logprobs: list[float],
                                rows: np.ndarray, start: int = 0) -> None:
    """rows: one per token of prompt + output but the last, from `start` on; logprobs: one per
    output token."""
    ids = list(prompt) + list(output)
    want_logprobs, want_rows = hf_logprobs_and_rows(hf_model, ids)
    assert rows.shape[0] == len(ids) - 1 - start > 0
    np.testing.assert_array_equal(rows.reshape(want_rows[start:-1].shape), want_rows[start:-1])
    assert len(logprobs) == len(output) > 0
    for j, value in enumerate(logprobs):
        i = len(prompt) + j
        assert value == pytest.approx(want_logprobs[i - 1, ids[i]].item(), abs=1e-4), i
        assert want_logprobs[i - 1, ids[i]] >= want_logprobs[i - 1].max() - 1e-4  # greedy: the top token


@pytest.fixture(scope="module")
def areal_run(server, checkpoints, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("areal")
    addr = urlparse(server.url).netloc
    return drive(server, workdir, "areal", addr, str(server.replicas), str(checkpoints["first"]),
                 str(checkpoints["second"]), str(workdir))


@pytest.mark.parametrize("phase, weights", [("before", "first"), ("after_xccl", "second"), ("after_disk", "first")])
def test_areal_rollouts_on_each_policy(areal_run, hf, phase, weights):
    assert areal_run["backend"] == "gloo"
    for got in areal_run[phase]:
        assert got["stop_reason"] == "length"
        # AReaL reshapes the int32 rows to (prompt + completion - 1, layers * top_k)
        assert_matches_transformers(hf[weights], got["input_tokens"], got["output_tokens"], got["output_logprobs"],
                                    np.asarray(got["rows"]))


def test_areal_second_turn_reuses_the_first(areal_run):
    first, second = areal_run["before"][:2]
    turn1 = first["input_tokens"] + first["output_tokens"]
    assert second["input_tokens"][:len(turn1)] == turn1
    np.testing.assert_array_equal(np.asarray(second["rows"])[:len(turn1) - 1], np.asarray(first["rows"]))


@pytest.fixture(scope="module")
def skyrl_run(server, tmp_path_factory):
    return drive(server, tmp_path_factory.mktemp("skyrl"), "skyrl", server.url, MODEL)


def test_skyrl_rollout_and_second_turn(skyrl_run, hf):
    assert skyrl_run["cache_salt"].startswith(MODEL)
    for got in skyrl_run["turn1"]:
        assert got["rows_dtype"] == "uint8" and got["stop_reason"] == "length"
        assert_matches_transformers(hf["first"], got["prompt"], got["response_ids"], got["response_logprobs"],
                                    np.asarray(got["rows"]))
    for got in skyrl_run["turn2"]:  # only the rows the second turn adds, from `start` on
        assert_matches_transformers(hf["first"], got["prompt"], got["response_ids"], got["response_logprobs"],
                                    np.asarray(got["rows"]), start=got["start"])


def test_skyrl_control_plane(skyrl_run, server):
    # vLLM reports dp * tp per server; SkyRL was given the one URL
    assert skyrl_run["world_size"] == [server.replicas, server.replicas]
    one = httpx.get(server.url + "/get_world_size", params={"include_dp": "false"}, timeout=30)
    assert one.status_code == 200 and one.json()["world_size"] == 1  # one replica's ranks (tp 1)
    assert skyrl_run["sleeping"] is True and skyrl_run["awake"] is True
    first = skyrl_run["turn1"][0]
    again = skyrl_run["after_wake"]
    assert (again["response_ids"], again["rows"]) == (first["response_ids"], first["rows"])
    assert again["response_logprobs"] == pytest.approx(first["response_logprobs"], abs=1e-5)
