"""A hybrid model (Qwen3-Next) over HTTP with the openai client: the routed experts equal the
offline engine's, a bad prompt start is a 400, and a client that hangs up mid-stream gives back
its state slot with its KV blocks (/metrics)."""

import base64
import io
import time

import httpx
import numpy as np
import openai
import pytest
from server_fixture import TEST_SERVER_ARGS, RemoteServer
from tiny_checkpoints import write_tiny_checkpoint

from r3srv import LLM, SamplingParams

pytestmark = pytest.mark.slow  # real servers

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(write_tiny_checkpoint(tmp_path_factory.mktemp("hybrid") / "qwen3_next", "qwen3_next", seed=8, num_layers=3))


@pytest.fixture(scope="module")
def server(checkpoint, gate):
    with RemoteServer(checkpoint, "--enable-return-routed-experts", *TEST_SERVER_ARGS, step_gate=gate) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused")


def _metric(server, name: str) -> float:
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def test_routed_experts_equal_the_offline_engine(server, client, checkpoint):
    prompt = list(b"Hybrid routing replay")
    r = client.completions.create(
        model=client.models.list().data[0].id, prompt=prompt, max_tokens=9, temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True, "routed_experts_prompt_start": 4},
    )
    choice = r.choices[0]
    rows = np.load(io.BytesIO(base64.b64decode(choice.routed_experts)))
    offline = LLM(checkpoint, max_model_len=128).generate(
        [prompt], SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True, routed_experts_prompt_start=4)
    )[0].outputs[0]
    assert choice.model_extra["token_ids"] == list(offline.token_ids)
    assert rows.shape == (len(prompt) + 9 - 1 - 4, 3, 2) and rows.dtype == np.uint8
    np.testing.assert_array_equal(rows, offline.routed_experts)


def test_bad_prompt_start_is_a_400(server, client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=client.models.list().data[0].id, prompt=[1, 2, 3], max_tokens=2,
                                  extra_body={"routed_experts_prompt_start": 4})
    assert "routed_experts_prompt_start" in str(err.value)


def test_stream_disconnect_gives_back_the_state_slot(server, gate):
    assert _metric(server, "r3srv_state_slots_total") == 16  # --max-num-seqs
    body = {"prompt": "x" * 40, "max_tokens": 400, "ignore_eos": True, "stream": True}
    # the prefill and one decode step, then held in flight: only the disconnect can end it
    with gate.allowing(2), httpx.Client(timeout=60) as http:
        with http.stream("POST", server.url + "/v1/completions", json=body) as r:
            lines = r.iter_lines()  # keep a reference: dropping the iterator closes the connection
            assert next(line for line in lines if line.startswith("data: "))
            assert _metric(server, "r3srv_state_slots_used") == 1
            r.close()
            del lines
        deadline = time.monotonic() + 30
        while (_metric(server, "r3srv_state_slots_used") or _metric(server, "r3srv_kv_blocks_used")) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _metric(server, "r3srv_state_slots_used") == 0 and _metric(server, "r3srv_kv_blocks_used") == 0


def test_multi_turn_rollouts_resume_from_snapshots_with_the_rows_of_one_pass(server, client, checkpoint):
    """examples/rl_rollout.py's multi-turn episode on the hybrid: each turn resumes from the state
    snapshot the last one left (prefix hits on /metrics), and the rows stitched turn by turn
    equal those of the whole conversation computed cold in one pass (offline, no prefix cache)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "examples" / "rl_rollout.py"
    spec = importlib.util.spec_from_file_location("rl_rollout", path)
    rollout = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rollout)
    model = client.models.list().data[0].id
    hits = _metric(server, "r3srv_prefix_cache_hits_total")
    tokens, rows, _ = rollout.episode(client, model, [list(b"Hi! " * 5), list(b" How?" * 4), list(b" Ok")], 9)
    assert _metric(server, "r3srv_prefix_cache_hits_total") > hits  # turns 2 and 3 resumed
    cold = LLM(checkpoint, max_model_len=128, enable_prefix_caching=False)
    whole = cold.generate([tokens[:-1]], SamplingParams(max_tokens=1, ignore_eos=True))[0].outputs[0].routed_experts
    assert whole.shape == rows.shape
    np.testing.assert_array_equal(rows, whole)
