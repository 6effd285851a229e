"""prime-rl's rollout client, its own code, against r3srv: verifiers 0.4.0's TrainClient (with
renderers 0.1.12) runs generated multi-turn conversations on /inference/v1/generate, bridging
each turn onto the previous one with `routed_experts_prompt_start`, and its trace graph stitches
the turns' rows, logprobs and tokens into the branch prime-rl trains on.

verifiers pins openai<3, so it runs in its own venv (tools/verifiers_env.sh builds .verifiers_venv;
`make test` does) as a subprocess (tests/verifiers_rollout.py). r3srv is served as docs/rl.md's
prime-rl recipe says, once alone and once as a 2-replica fleet behind its one URL.

Oracle: transformers on the branch's token ids: every row but the last equals its router's
top-k (the last position was never forwarded: verifiers pads it with a copy of the row before),
and each sampled token's logprob is transformers' log-softmax at that position.
"""

from __future__ import annotations

import asyncio
import base64
import json
import subprocess
from pathlib import Path

import numpy as np
import openai
import pytest
import torch
from renderers import create_renderer
from renderers.base import load_tokenizer
from renderers.client import generate

from server_fixture import TEST_SERVER_ARGS, RemoteServer
from tiny_checkpoints import build_hf_model, hf_logprobs_and_rows, write_tiny_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.peer]  # a real server, a subprocess, a transformers oracle

ROOT = Path(__file__).resolve().parent.parent
VERIFIERS_PYTHON = ROOT / ".verifiers_venv" / "bin" / "python"
ROLLOUT = Path(__file__).parent / "verifiers_rollout.py"
SEED = 3
TURNS = 3
MODEL = "prime-policy"
PRIME_RL_FLAGS = ("--enable-return-routed-experts", "--routed-experts-encoding", "prime-rl",
                  "--return-tokens-as-token-ids", "--generate-logprobs-format", "openai")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("prime") / "ckpt", seed=SEED)


@pytest.fixture(scope="module")
def hf():
    return build_hf_model("qwen3_moe", seed=SEED)


@pytest.fixture(scope="module", params=["server", "fleet"])
def server(request, checkpoint):
    topology = ("--data-parallel-size", "2") if request.param == "fleet" else ()
    with RemoteServer(str(checkpoint), "--served-model-name", MODEL, *PRIME_RL_FLAGS, *topology,
                      *TEST_SERVER_ARGS) as srv:
        yield srv
    assert srv.returncode == 0, srv.log


def rollout(server, checkpoint: Path, seed: int, tmp_path: Path) -> dict:
    if not VERIFIERS_PYTHON.exists():
        pytest.skip("no verifiers environment at .verifiers_venv: tools/verifiers_env.sh creates it (make test does)")
    out = tmp_path / f"rollout{seed}.json"
    proc = subprocess.run([str(VERIFIERS_PYTHON), str(ROLLOUT), server.url, str(checkpoint), MODEL, str(TURNS),
                           str(seed), str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:] + "\nserver log:\n" + server.log[-3000:]
    return json.loads(out.read_text(encoding="utf-8"))


def transformers_run(hf, ids: list[int]) -> tuple[torch.Tensor, np.ndarray]:
    """log-softmax [T, V] and router top-k rows [T, L, k] of transformers on `ids`."""
    return hf_logprobs_and_rows(hf, ids)


@pytest.mark.parametrize("seed", [0, 1])
def test_multi_turn_rollout_rows_and_logprobs_as_prime_rl_trains_on_them(server, checkpoint, hf, seed, tmp_path):
    got = rollout(server, checkpoint, seed, tmp_path)
    ids = got["token_ids"]
    prefixes = got["turn_prefix_lengths"]
    assert len(prefixes) == TURNS and prefixes[0] == 0 and prefixes == sorted(set(prefixes))  # later turns bridged
    rows = np.asarray(got["rows"])
    assert got["rows_dtype"] == "uint8" and rows.shape[0] == len(ids)  # one row per token, as prime-rl's trainer takes
    logprobs, want = transformers_run(hf, ids)
    assert rows.shape[1:] == want.shape[1:]
    np.testing.assert_array_equal(rows[:-1], want[:-1])
    np.testing.assert_array_equal(rows[-1], rows[-2])  # verifiers' placeholder for the unforwarded last position
    sampled = [i for i, s in enumerate(got["sampled"]) if s]
    assert len(got["sampled"]) == len(ids) and len(sampled) >= TURNS and 0 not in sampled
    for i in sampled:
        assert got["logprobs"][i] == pytest.approx(logprobs[i - 1, ids[i]].item(), abs=1e-4), i
        assert logprobs[i - 1, ids[i]] >= logprobs[i - 1].max() - 1e-4  # greedy: the top token


def test_renderers_generate_reads_the_recipes_answer(server, checkpoint, hf):
    """renderers' own `generate` (r3srv's venv has renderers, with openai 3): one turn, the
    response parsed by its strict logprob and rows checks, against transformers."""
    renderer = create_renderer(load_tokenizer(str(checkpoint)), None)
    messages = [{"role": "user", "content": "which experts route this?"}]

    async def one_turn() -> dict:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="EMPTY")
        try:
            return await generate(client=client, renderer=renderer, messages=messages, model=MODEL,
                                  sampling_params={"temperature": 0.0, "max_tokens": 5})
        finally:
            await client.close()

    got = asyncio.run(one_turn())
    ids = list(got["prompt_ids"]) + list(got["completion_ids"])
    logprobs, want = transformers_run(hf, ids)
    payload = got["routed_experts"]
    rows = np.frombuffer(base64.b64decode(bytes(payload["data"])),
                         dtype=payload["dtype"]).reshape(payload["shape"])
    np.testing.assert_array_equal(rows, want[int(payload.get("start") or 0):-1])
    prompt_len = len(got["prompt_ids"])
    assert len(got["completion_logprobs"]) == len(got["completion_ids"]) > 0
    for j, value in enumerate(got["completion_logprobs"]):
        i = prompt_len + j
        assert value == pytest.approx(logprobs[i - 1, ids[i]].item(), abs=1e-4)
