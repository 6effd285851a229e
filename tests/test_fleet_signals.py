"""Through a `--data-parallel-size 2` fleet's one URL, the replay signals and a trainer's adapter
push, each against a single server started with the same flags on the same tiny Qwen3-MoE:
sampling masks (SGLang's `output_token_sampling_mask`, vLLM's `sampling_mask`), the router's
weights beside the rows (`--enable-return-routed-expert-weights`), and a LoRA adapter a trainer
broadcasts over the weight-update group (/load_lora_adapter_from_distributed, a world of the
trainer and one rank per replica), which both replicas then serve as the single server does (and
as PEFT computes it); an adapter loaded from disk and unloaded on every replica. One fleet and one
single server for the module, and for the sparse-attention indexer's selections
(`--enable-return-indexer-topk`) one of each on a tiny GLM-MoE-DSA, run one after the other."""

from __future__ import annotations

import base64
import concurrent.futures
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
import weight_sync_trainer as trainer
from lora_testing import checkpoint_and_two_adapters, peft_reference, prompt
from server_fixture import TEST_SERVER_ARGS, RemoteServer
from test_lora_push import FAMILY, NAME, assert_peft, completion, push_adapter

from r3srv import serial

pytestmark = pytest.mark.slow  # real servers, a trainer's group, a PEFT oracle

PROMPT = prompt(12, 3)
# seeded draws from supports of several ids (the tiny model's random weights are near flat)
SAMPLING = {"max_new_tokens": 6, "temperature": 1.0, "top_k": 20, "top_p": 0.9, "ignore_eos": True,
            "sampling_seed": 7}
WEIGHT_RTOL, WEIGHT_ATOL = 1e-5, 1e-6  # a prefix-cache hit's tail computes in another shape (docs/replay.md)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return checkpoint_and_two_adapters(tmp_path_factory.mktemp("fleet_signals"), FAMILY)


def server_args(ckpt) -> tuple[str, ...]:
    return (str(ckpt), "--enable-lora", "--enable-weight-updates", "--enable-return-routed-experts",
            "--enable-return-routed-expert-weights", "--return-sampling-mask", "--max-loras", "2", "--max-model-len", "96",
            *TEST_SERVER_ARGS)


@pytest.fixture(scope="module")
def single(files):
    with RemoteServer(*server_args(files[0])) as srv:
        yield srv
    assert srv.returncode == 0, srv.log


@pytest.fixture(scope="module")
def fleet(files):
    with RemoteServer(*server_args(files[0]), "--data-parallel-size", "2") as srv:
        yield srv
    assert srv.returncode == 0, srv.log


@pytest.fixture(scope="module")
def replicas(fleet) -> list[str]:
    urls = [s["url"] for s in httpx.get(fleet.url + "/server_info", timeout=30).json()["internal_states"]]
    assert len(set(urls)) == 2
    return urls


@pytest.fixture
def pool():
    with concurrent.futures.ThreadPoolExecutor(2) as threads:
        yield threads


def post(url: str, path: str, body: dict) -> dict:
    r = httpx.post(url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def sglang_signals(url: str) -> dict:
    """SGLang's /generate with masks and router weights, decoded as a client does."""
    out = post(url, "/generate", {"input_ids": PROMPT, "sampling_params": SAMPLING, "return_sampling_mask": True,
                                  "return_routed_expert_weights": True})
    meta = out["meta_info"]
    weights = serial.decode_expert_weights(meta["routed_expert_weights"])
    rows = np.frombuffer(base64.b64decode(meta["routed_experts"]), np.int32).reshape(weights.shape)
    return {"tokens": out["output_ids"], "masks": meta["output_token_sampling_mask"], "rows": rows, "weights": weights}


def tito_signals(url: str) -> dict:
    """vLLM's /inference/v1/generate: masks by the server's flag, router weights asked for."""
    sampling = {"max_tokens": 6, "temperature": 1.0, "top_k": 20, "top_p": 0.9, "ignore_eos": True, "seed": 7,
                "return_routed_expert_weights": True}
    choice = post(url, "/inference/v1/generate", {"token_ids": PROMPT, "sampling_params": sampling})["choices"][0]
    return {"tokens": choice["token_ids"], "masks": choice["sampling_mask"],
            "rows": serial.decode_routed_experts(choice["routed_experts"]),
            "weights": serial.decode_expert_weights(choice["routed_expert_weights"])}


def assert_same(got: dict, want: dict) -> None:
    assert got["tokens"] == want["tokens"] and got["masks"] == want["masks"]
    np.testing.assert_array_equal(got["rows"], want["rows"])
    assert got["weights"].shape == want["rows"].shape and np.count_nonzero(got["weights"]) > 0
    np.testing.assert_allclose(got["weights"], want["weights"], rtol=WEIGHT_RTOL, atol=WEIGHT_ATOL)


@pytest.mark.parametrize("signals", [sglang_signals, tito_signals], ids=["sglang", "vllm"])
def test_masks_and_router_weights_through_the_fleets_url(single, fleet, signals):
    want = signals(single.url)
    assert max(len(m) for m in want["masks"]) > 1  # supports wide enough to matter
    for _ in range(2):  # cold, then over the prefix cache of the replica that served it
        assert_same(signals(fleet.url), want)


def test_an_adapter_pushed_over_the_group_reaches_both_replicas(single, fleet, replicas, files, pool):
    """The trainer opens one group of 1 + 2 ranks; the front gives replica i rank 1 + i and
    sends the announcement to both, which receive the same broadcasts."""
    _, a1, _ = files
    p = prompt(9, 4)
    with trainer.joined(single.url, pool) as group:
        r = push_adapter(single, group, pool, a1)
        assert r.status_code == 200, r.text
    want = completion(single, p)
    assert_peft(want, a1, p, 1)
    with trainer.joined(fleet.url, pool, world_size=3) as group:
        r = push_adapter(fleet, group, pool, a1)
        assert r.status_code == 200 and r.json()["loaded_adapters"] == {NAME: "__tensor__"}, r.text
    for url in [*replicas, fleet.url]:  # each replica directly, and the fleet's URL
        got = completion(SimpleNamespace(url=url), p)
        assert got.token_ids == want.token_ids, url
        assert got.logprobs.token_logprobs == want.logprobs.token_logprobs, url
        assert (got.model_extra["lora_name"], got.model_extra["lora_version"]) == (NAME, 1), url



def test_an_adapter_from_disk_loads_and_unloads_on_every_replica(fleet, replicas, files):
    """The front sends load and unload to both replicas; each then serves the adapter (as PEFT
    computes it) and lists it, and forgets it after the unload."""
    _, _, a2 = files
    r = httpx.post(fleet.url + "/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": str(a2)}, timeout=120)
    assert r.status_code == 200, r.text
    p = prompt(9, 4)
    want = peft_reference(FAMILY, a2, p, 4).tokens
    for url in replicas:
        assert "a2" in {m["id"] for m in httpx.get(url + "/v1/models", timeout=30).json()["data"]}
        out = post(url, "/v1/completions", {"model": "a2", "prompt": p, "max_tokens": 4, "temperature": 0,
                                            "return_token_ids": True})
        assert out["choices"][0]["token_ids"] == want
    r = httpx.post(fleet.url + "/unload_lora_adapter", json={"lora_name": "a2"}, timeout=120)
    assert r.status_code == 200, r.text
    for url in replicas:
        assert "a2" not in {m["id"] for m in httpx.get(url + "/v1/models", timeout=30).json()["data"]}


DSA_PROMPT = list(b"Sparse attention, replayed")


def dsa_selections(url: str) -> dict:
    """Indexer top-k on SGLang's /generate (raw int32, every layer) and vLLM's
    /inference/v1/generate (base64 .npy, the indexer layers), greedy, as the wire carries them."""
    greedy = {"temperature": 0.0, "ignore_eos": True}
    sglang = post(url, "/generate", {"input_ids": DSA_PROMPT, "return_indexer_topk": True,
                                     "sampling_params": {"max_new_tokens": 6, **greedy}})
    tito = post(url, "/inference/v1/generate", {"token_ids": DSA_PROMPT, "sampling_params": {
        "max_tokens": 6, "indexer_topk_prompt_start": 2, **greedy}})["choices"][0]
    return {"sglang": (sglang["output_ids"], sglang["meta_info"]["indexer_topk"]),
            "vllm": (tito["token_ids"], tito["indexer_topk"])}


@pytest.fixture(scope="module")
def dsa_answers(tmp_path_factory):
    """A single server's and a two-replica fleet's answers (twice: cold, then over the serving
    replica's prefix cache) on a tiny GLM-MoE-DSA (full, shared, full; index_topk 5), one
    server at a time."""
    from tiny_checkpoints import write_tiny_checkpoint

    pytest.importorskip("transformers")
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("dsa") / "glm5", "glm_moe_dsa", seed=4, num_layers=3,
                                 indexer_types=["full", "shared", "full"], first_k_dense_replace=1)
    args = (str(path), "--enable-return-indexer-topk", "--dtype", "float32", *TEST_SERVER_ARGS)
    with RemoteServer(*args) as srv:
        single = dsa_selections(srv.url)
    assert srv.returncode == 0, srv.log
    with RemoteServer(*args, "--data-parallel-size", "2") as srv:
        fleet = [dsa_selections(srv.url) for _ in range(2)]
    assert srv.returncode == 0, srv.log
    return single, fleet


@pytest.mark.parametrize("route", ["sglang", "vllm"])
def test_indexer_topk_through_the_fleets_url(dsa_answers, route):
    single, fleet = dsa_answers
    tokens, encoded = single[route]
    if route == "sglang":
        topk = serial.decode_raw(encoded, "int32", (3, 5))
        assert topk.shape[0] == len(DSA_PROMPT) + len(tokens) - 1
    else:
        topk = serial.decode_routed_experts(encoded)
        assert topk.shape == (len(DSA_PROMPT) + len(tokens) - 1 - 2, 2, 5)
    assert (topk[:, :, -1] > 4).any()  # sparse rows: 5 keys picked among more
    for answer in fleet:
        assert answer[route] == (tokens, encoded)  # the same tokens and the same bytes
