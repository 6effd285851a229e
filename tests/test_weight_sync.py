"""A trainer pushing a new policy into a real server over torch.distributed (gloo on the CPU):
SGLang's /init_weights_update_group + /update_weights_from_distributed, vLLM's weight-transfer
names, and prime-rl's /pause?mode=keep + /update_weights {weight_dir} + /resume."""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import shutil

import httpx
import numpy as np
import openai
import pytest
import torch
import torch.distributed as dist
import weight_sync_trainer as trainer
from server_fixture import TEST_SERVER_ARGS, RemoteServer, free_port
from test_server_weights import offline, post, served
from tiny_checkpoints import write_tiny_checkpoint

from engine_testing import GREEDY, prompt_ids
from r3srv import LLM, SamplingParams

# real servers; the trainers' weight-update calls (SGLang's, vLLM's, prime-rl's)
pytestmark = [pytest.mark.slow, pytest.mark.peer]

PROMPT = prompt_ids(20, base=3)
LONG = 24  # tokens of a request held in flight by the gate (2 steps) while the test pauses and updates


@pytest.fixture(scope="module")
def policies(tmp_path_factory):
    root = tmp_path_factory.mktemp("pushed-policies")
    return write_tiny_checkpoint(root / "v0", seed=0), write_tiny_checkpoint(root / "v1", seed=1)


@pytest.fixture(scope="module")
def server(policies, gate):
    args = (str(policies[0]), "--enable-weight-updates", "--enable-return-routed-experts", "--weight-sync-timeout", "8")
    with RemoteServer(*args, *TEST_SERVER_ARGS, step_gate=gate) as srv:
        yield srv
    assert srv.returncode == 0, srv.log


@pytest.fixture
def pool():
    with concurrent.futures.ThreadPoolExecutor(2) as threads:
        yield threads


def serves(server, policy) -> bool:
    """The server's greedy tokens and routed experts are those of `policy` loaded from disk."""
    ids, rows, _ = served(server, PROMPT)
    want_ids, want_rows = offline(policy, PROMPT)
    return ids == want_ids and np.array_equal(rows, want_rows)


def joined(server, pool):
    """A gloo group of this process (the trainer, rank 0) and the server, torn down after."""
    return trainer.joined(server.url, pool)


def push_policy(server, group, pool, policy) -> None:
    r = trainer.push(server.url, group, trainer.checkpoint_tensors(policy), pool)
    assert r.status_code == 200, r.text
    assert serves(server, policy)


def reset(server, policy, version: str = "0") -> None:
    r = post(server, "/update_weights_from_disk", {"model_path": str(policy), "weight_version": version})
    assert r.status_code == 200, r.text


def test_a_broadcast_policy_serves_as_the_same_policy_loaded_from_disk(server, policies, pool):
    v0, v1 = policies
    reset(server, v0)
    assert serves(server, v0)
    with joined(server, pool) as group:
        tensors = trainer.checkpoint_tensors(v1)
        names = list(tensors)
        first, rest = names[: len(names) // 2], names[len(names) // 2:]
        # A bucket that leaves parameters unfilled is staged; the served weights do not change.
        r = trainer.push(server.url, group, {n: tensors[n] for n in first}, pool, weight_version="step-1")
        assert r.status_code == 200 and r.json()["success"] is True and "staged" in r.json()["message"], r.text
        assert serves(server, v0)
        r = trainer.push(server.url, group, {n: tensors[n] for n in rest}, pool, weight_version="step-1")
        assert r.status_code == 200 and "updated" in r.json()["message"], r.text
        assert serves(server, v1)
        assert served(server, PROMPT)[2] == "step-1"
        assert httpx.get(server.url + "/weight_info").json() == {"weight_version": "step-1"}


@pytest.mark.parametrize("fault, param, named", [
    ("unknown", "names", "model.layers.0.mlp.no_such.weight"),
    ("shape", "names", "model.norm.weight"),
    ("dtype", "names", "model.norm.weight"),
    ("bad_dtype", "dtypes", "float33"),
    ("lengths", "shapes", "same length"),
])
def test_a_bad_announcement_is_a_400_naming_it_before_anything_is_received(server, policies, pool, fault, param,
                                                                          named):
    v0, v1 = policies
    reset(server, v0)
    with joined(server, pool) as group:
        body = trainer.announce(trainer.checkpoint_tensors(v1))
        i = body["names"].index("model.norm.weight")
        if fault == "unknown":
            body["names"][i] = named
        elif fault == "shape":
            body["shapes"][i] = [body["shapes"][i][0] + 1]
        elif fault == "dtype":
            body["dtypes"][i] = "int32"
        elif fault == "bad_dtype":
            body["dtypes"][i] = "float33"
        else:
            body["shapes"].pop()
        # Nothing is broadcast: the answer comes before the server waits for any tensor.
        r = post(server, "/update_weights_from_distributed", body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param and named in r.json()["error"]["message"]
        assert serves(server, v0) and served(server, PROMPT)[2] == "0"
        push_policy(server, group, pool, v1)  # the group still works


def test_a_trainer_dying_mid_broadcast_leaves_the_old_weights_serving(server, policies, pool):
    v0, v1 = policies
    reset(server, v0, version="old")
    port = free_port()
    dying = multiprocessing.get_context("spawn").Process(
        target=trainer.push_then_die, args=(server.url, port, v1, 3), daemon=True)
    dying.start()
    dying.join(120)
    assert dying.exitcode == 3
    # The server notices the dead peer, drops what it received and the group with it.
    r = trainer.group_dropped(server.url)
    assert r.status_code == 400 and r.json()["error"]["param"] == "group_name", r.text
    assert httpx.get(server.url + "/health").status_code == 200
    assert serves(server, v0) and served(server, PROMPT)[2] == "old"
    with joined(server, pool) as group:  # a new group of the same name works
        push_policy(server, group, pool, v1)


def test_a_trainer_stalling_mid_broadcast_fails_the_update_after_the_timeout(server, policies, pool):
    v0, v1 = policies
    reset(server, v0, version="old")
    group = trainer.join(server.url, free_port(), pool)
    try:
        tensors = trainer.checkpoint_tensors(v1)
        reply = pool.submit(post, server, "/update_weights_from_distributed", trainer.announce(tensors))
        first = next(iter(tensors.values()))
        dist.broadcast(first.contiguous(), src=0, group=group)  # then nothing more: a hung trainer
        r = reply.result()  # the server gives up after --weight-sync-timeout (8 s here)
        assert r.status_code == 400 and f"after 1 of {len(tensors)} tensors" in r.json()["error"]["message"], r.text
        assert serves(server, v0) and served(server, PROMPT)[2] == "old"
        r = post(server, "/update_weights_from_distributed", trainer.announce({}))
        assert r.status_code == 400 and r.json()["error"]["param"] == "group_name"  # the group is gone
    finally:
        dist.destroy_process_group(group)


def test_vllm_weight_transfer_names_map_onto_the_same_group(server, policies, pool):
    v0, v1 = policies
    reset(server, v0)
    port = free_port()
    group = trainer.vllm_join(server.url, port, pool)
    try:
        assert post(server, "/start_weight_update").status_code == 200
        tensors = trainer.checkpoint_tensors(v1)
        r = trainer.vllm_push(server.url, group, tensors, pool)
        assert r.status_code == 200, r.text
        assert serves(server, v0)  # applied at /finish_weight_update only
        r = post(server, "/finish_weight_update", {"weight_version": "vllm-1"})
        assert r.status_code == 200, r.text
        assert serves(server, v1) and served(server, PROMPT)[2] == "vllm-1"
        # What r3srv does not implement, or vLLM refuses, is a 400 naming it.
        init_info = trainer.vllm_init_info(port)
        for bad, param in ((dict(init_info, packed=True, packed_buffer_size_bytes=0), "packed_buffer_size_bytes"),
                           (dict(init_info, nccl_unique_id_b64="AAAA"), "nccl_unique_id_b64")):
            r = post(server, "/init_weight_transfer_engine", {"init_info": bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == f"init_info.{param}", r.text
        r = post(server, "/update_weights", {"update_info": trainer.vllm_update_info(tensors), "other": 1})
        assert r.status_code == 400 and "other" in r.text, r.text
    finally:
        dist.destroy_process_group(group)
        assert post(server, "/shutdown_weight_transfer_engine").status_code == 200


def test_vllm_packed_weight_transfer_cuts_chunks_as_vllm_does(server, policies, pool):
    """init_info packed: every round's tensors arrive as vLLM's packed uint8 chunks, here of a
    little over 64 KiB each (the built-in default is 1 GiB: one chunk for a tiny model)."""
    v0, v1 = policies
    reset(server, v0)
    group = trainer.vllm_join(server.url, free_port(), pool, packed=True, packed_buffer_size_bytes=1 << 16)
    try:
        assert post(server, "/start_weight_update").status_code == 200
        tensors = trainer.checkpoint_tensors(v1)
        assert len(trainer.vllm_packed(tensors, 1 << 16)) > 3
        r = trainer.vllm_push(server.url, group, tensors, pool, packed_bytes=1 << 16)
        assert r.status_code == 200, r.text
        assert post(server, "/finish_weight_update", {"weight_version": "packed-1"}).status_code == 200
        assert serves(server, v1) and served(server, PROMPT)[2] == "packed-1"
    finally:
        dist.destroy_process_group(group)
        assert post(server, "/shutdown_weight_transfer_engine").status_code == 200


def test_prime_rl_pause_keep_update_resume_recomputes_frozen_sequences_on_the_new_policy(server, policies, tmp_path,
                                                                                        gate):
    """prime-rl: /pause?mode=keep, /update_weights {weight_dir} (shards and index, no config.json),
    /resume. The rule: a sequence frozen in keep mode is retracted by the update and recomputes
    every token on the new weights, so its routed experts are all the new policy's."""
    v0, v1 = policies
    reset(server, v0)
    shards = tmp_path / "step-1"
    shards.mkdir()
    for f in v1.glob("*.safetensors*"):
        shutil.copy(f, shards)
    assert not (shards / "config.json").exists()
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    with gate.allowing(2):  # the prefill and one decode step, then held short of its LONG tokens
        stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=LONG, temperature=0.0, stream=True,
                                           extra_body={"return_token_ids": True, "ignore_eos": True})
        chunks = [next(iter(stream))]  # the request is running, holding KV of the old weights
        assert httpx.post(server.url + "/pause", params={"mode": "keep", "clear_cache": "false"}).json() == {
            "status": "paused"}
        assert httpx.get(server.url + "/is_paused").json()["is_paused"] is True
        r = post(server, "/update_weights", {"weight_dir": str(shards)})
        assert r.status_code == 200, r.text
        assert httpx.post(server.url + "/resume").json() == {"status": "resumed"}
    chunks += [c for c in stream if c.choices]
    final = chunks[-1].choices[0]
    tokens = [t for c in chunks for t in c.choices[0].token_ids]
    assert len(tokens) == LONG and final.weight_version == str(shards)
    # Oracle: the new policy reading the whole sequence (prompt and every sampled token).
    from r3srv.serial import decode_routed_experts

    sequence = PROMPT + tokens[:-1]
    want = LLM(str(v1), num_kv_blocks=256, max_num_seqs=16, enable_return_routed_experts=True).generate(
        [sequence], SamplingParams(max_tokens=1, **GREEDY))[0].outputs[0].routed_experts
    assert np.array_equal(decode_routed_experts(final.routed_experts), want)
    assert serves(server, v1)
    r = post(server, "/update_weights", {"weight_dir": None})
    assert r.status_code == 400 and r.json()["error"]["param"] == "weight_dir"


def test_pause_wait_returns_once_the_requests_in_flight_have_finished(server, gate, pool):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    with gate.allowing(2):  # held short of its 24 tokens until the gate opens
        stream = client.completions.create(model=client.models.list().data[0].id, prompt=PROMPT, max_tokens=24,
                                           temperature=0.0, stream=True, extra_body={"ignore_eos": True})
        next(iter(stream))
        pause = pool.submit(httpx.post, server.url + "/pause", params={"mode": "wait"}, timeout=120)
        with pytest.raises(concurrent.futures.TimeoutError):
            pause.result(timeout=1.0)  # it cannot have answered: the request is in flight until the gate opens
    assert pause.result(timeout=120).json() == {"status": "paused"}
    stats = httpx.get(server.url + "/metrics").text
    assert "r3srv_num_requests_running 0.0" in stats  # it finished before the pause answered
    rest = [c for c in stream if c.choices]
    assert rest[-1].choices[0].finish_reason == "length"
    assert httpx.post(server.url + "/resume").json() == {"status": "resumed"}


def test_pause_modes_and_bad_mode(server, policies):
    r = httpx.post(server.url + "/pause", params={"mode": "retract"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "mode"
    for mode in ("abort", "wait", "keep"):
        assert httpx.post(server.url + "/pause", params={"mode": mode}).json() == {"status": "paused"}
        assert httpx.get(server.url + "/is_paused").json() == {"is_paused": True, "mode": mode}
        assert httpx.post(server.url + "/resume").json() == {"status": "resumed"}


def test_update_weights_from_tensor_is_a_400_on_the_cpu_and_runs_no_pickled_code(server, tmp_path):
    import base64
    import os
    import pickle

    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    body = {"serialized_named_tensors": [base64.b64encode(pickle.dumps([("x", Payload())])).decode()]}
    r = post(server, "/update_weights_from_tensor", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "serialized_named_tensors"
    assert "CUDA" in r.json()["error"]["message"] and not marker.exists()
    r = post(server, "/update_weights_from_tensor", dict(body, load_format="flattened_bucket"))
    assert r.status_code == 400 and r.json()["error"]["param"] == "load_format", r.text
    r = post(server, "/update_weights_from_tensor", dict(body, selector="draft"))
    assert r.status_code == 400 and r.json()["error"]["param"] == "selector", r.text

