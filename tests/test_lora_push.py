"""A trainer pushing LoRA adapters into a real server over the weight-update group (gloo on the
CPU), as full weights go: /init_weights_update_group, then /load_lora_adapter_from_distributed
naming the adapter's PEFT tensors while this process (rank 0) broadcasts them. Pushed again under
the same name, the adapter is replaced in place between batches (PEFT + transformers the oracle
of both versions); a bad announcement is a 400 before anything is received; a replacement while
a request runs under the adapter is refused, the adapter kept, unless generation is paused with
mode=keep, whose frozen sequence then finishes on the new version; under tensor parallelism
every rank receives."""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import openai
import pytest
import torch
import weight_sync_trainer as trainer
from lora_testing import checkpoint_and_two_adapters, peft_reference, prompt
from safetensors.torch import load_file
from server_fixture import TEST_SERVER_ARGS, RemoteServer

pytestmark = pytest.mark.slow  # a real server, a trainer's group, PEFT oracles

FAMILY, NAME, MAX_TOKENS, LONG = "qwen3_moe", "policy", 4, 16
ROUTE = "/load_lora_adapter_from_distributed"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return checkpoint_and_two_adapters(tmp_path_factory.mktemp("lora_push"), FAMILY)


@pytest.fixture(scope="module")
def server(files, gate):
    with lora_server(files[0], "--max-loras", "1", gate=gate) as srv:
        yield srv


@pytest.fixture
def pool():
    with concurrent.futures.ThreadPoolExecutor(2) as threads:
        yield threads


def peft_save(path) -> tuple[dict, dict[str, torch.Tensor]]:
    """What the trainer holds: PEFT's config and the adapter's state dict."""
    return json.loads((path / "adapter_config.json").read_text()), load_file(str(path / "adapter_model.safetensors"))


def lora_server(ckpt, *extra: str, gate=None) -> RemoteServer:
    return RemoteServer(str(ckpt), "--enable-lora", "--enable-weight-updates", "--max-model-len", "96",
                        "--weight-sync-timeout", "20", *extra, *TEST_SERVER_ARGS, step_gate=gate)  # a stall: 20 s


def push_adapter(server, group, pool, path) -> httpx.Response:
    config, tensors = peft_save(path)
    return trainer.push(server.url, group, tensors, pool, route=ROUTE, lora_name=NAME, config_dict=config)


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def completion(server, p: list[int]):
    out = client(server).completions.create(model=NAME, prompt=p, max_tokens=MAX_TOKENS, temperature=0, logprobs=0,
                                            extra_body={"return_token_ids": True})
    return out.choices[0]


def assert_peft(choice, path, p: list[int], version: int) -> None:
    ref = peft_reference(FAMILY, path, p, MAX_TOKENS)
    assert choice.token_ids == ref.tokens
    assert choice.logprobs.token_logprobs == pytest.approx(ref.logprobs, abs=2e-4)
    assert (choice.model_extra["lora_name"], choice.model_extra["lora_version"]) == (NAME, version)


def test_a_pushed_adapter_is_replaced_in_place_as_peft_computes_it(server, files, pool):
    _, a1, a2 = files
    p = prompt(9, 4)
    with trainer.joined(server.url, pool) as group:
        r = push_adapter(server, group, pool, a1)
        assert r.status_code == 200 and r.json()["loaded_adapters"] == {NAME: "__tensor__"}, r.text
        version = httpx.get(server.url + "/v1/models").json()["data"]  # listed with its parent
        assert NAME in {m["id"] for m in version}
        first = completion(server, p)
        v1 = first.model_extra["lora_version"]
        assert_peft(first, a1, p, v1)
        r = push_adapter(server, group, pool, a2)  # the next step's adapter, between batches
        assert r.status_code == 200, r.text
        assert_peft(completion(server, p), a2, p, v1 + 1)
        # an announcement the model cannot take: a 400 naming it before any tensor is received
        config, tensors = peft_save(a2)
        lacking = {k.replace("layers.1.", "layers.7."): v for k, v in tensors.items()}
        r = trainer.post(server.url, ROUTE, trainer.announce(lacking, lora_name=NAME, config_dict=config))
        assert r.status_code == 400 and r.json()["error"]["param"] == "names" and "layers.7" in r.text
        r = trainer.post(server.url, ROUTE, trainer.announce(tensors, lora_name=NAME, config_dict=dict(config, r=99)))
        assert r.status_code == 400 and r.json()["error"]["param"] == "names"
        assert_peft(completion(server, p), a2, p, v1 + 1)  # the adapter kept
    r = trainer.post(server.url, ROUTE, trainer.announce(tensors, lora_name=NAME, config_dict=config))
    assert r.status_code == 400 and r.json()["error"]["param"] == "group_name"  # no group: nothing to receive


def test_a_replacement_under_running_requests_needs_a_pause(server, files, pool, gate):
    _, a1, a2 = files
    with trainer.joined(server.url, pool) as group:
        assert push_adapter(server, group, pool, a1).status_code == 200
        version = completion(server, prompt(5, 1)).model_extra["lora_version"]
        with gate.allowing(2):  # the prefill and one decode step, then held short of LONG tokens
            stream = client(server).completions.create(model=NAME, prompt=prompt(9, 5), max_tokens=LONG, temperature=0,
                                                       stream=True, extra_body={"ignore_eos": True})
            chunks = [next(iter(stream))]  # running under the adapter
            r = push_adapter(server, group, pool, a2)
            assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name" and "in use" in r.text
            assert httpx.post(server.url + "/pause", params={"mode": "keep"}).json() == {"status": "paused"}
            r = push_adapter(server, group, pool, a2)  # paused with keep: the frozen sequence is retracted
            assert r.status_code == 200, r.text
            assert httpx.post(server.url + "/resume").json() == {"status": "resumed"}
    chunks += [c for c in stream if c.choices]
    final = [c for c in chunks if c.choices[0].finish_reason][-1].choices[0]
    assert final.finish_reason == "length"
    assert (final.model_extra["lora_name"], final.model_extra["lora_version"]) == (NAME, version + 1)
    p = prompt(9, 6)
    assert_peft(completion(server, p), a2, p, version + 1)


def test_a_push_reaches_both_tensor_parallel_ranks(files, pool):
    """-tp 2: both ranks join the trainer's group (ranks 1 and 2 of 3), receive every broadcast,
    and bind their own slices of the adapter rank 0 loads."""
    ckpt, a1, _ = files
    p = prompt(9, 7)
    with lora_server(ckpt, "--tensor-parallel-size", "2", "--dtype", "float32") as tp2:
        with trainer.joined(tp2.url, pool, world_size=3) as group:
            r = push_adapter(tp2, group, pool, a1)
            assert r.status_code == 200, r.text
        assert_peft(completion(tp2, p), a1, p, 1)
