"""LoRA over HTTP: vLLM's and SGLang's load/unload routes, an adapter selected by `model` (the
openai SDK) and by `lora_path` on SGLang's /generate, /v1/models listing it with its parent,
start-up flags, and bad input answered with OpenAI-shaped 4xx, the adapter kept."""

from __future__ import annotations

import httpx
import openai
import pytest
from lora_testing import checkpoint_and_two_adapters, peft_reference, prompt
from server_fixture import RemoteServer

pytestmark = pytest.mark.slow  # a real server, PEFT oracles

FAMILY = "qwen3_moe"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return checkpoint_and_two_adapters(tmp_path_factory.mktemp("lora_server"), FAMILY)


@pytest.fixture(scope="module")
def server(files):
    ckpt, a1, _ = files
    args = (str(ckpt), "--served-model-name", "base", "--enable-lora", "--max-loras", "2", "--max-model-len", "96",
            "--num-kv-blocks", "64", "--lora-modules", f"a1={a1}", "--device", "cpu")
    with RemoteServer(*args) as srv:
        yield srv


def test_adapters_by_model_name_and_lora_path(server, files):
    _, a1, a2 = files
    url = server.url
    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": str(a2)}, timeout=60)
    assert r.status_code == 200 and "a2" in r.text
    models = {m.id: m for m in openai.OpenAI(base_url=url + "/v1", api_key="x").models.list().data}
    assert set(models) == {"base", "a1", "a2"}
    assert models["a1"].model_extra["parent"] == "base"
    client = openai.OpenAI(base_url=url + "/v1", api_key="x")
    p = prompt(9, 4)
    for name, path in (("a1", a1), ("a2", a2), ("base", None)):
        out = client.completions.create(model=name, prompt=p, max_tokens=4, temperature=0,
                                        extra_body={"return_token_ids": True})
        assert out.choices[0].token_ids == peft_reference(FAMILY, path, p, 4).tokens
        # each choice names the adapter and version that produced it, the response the adapter (as vLLM)
        assert out.model == name
        assert (out.choices[0].model_extra.get("lora_name"), out.choices[0].model_extra.get("lora_version")) == (
            (None, None) if path is None else (name, 1))
    # a replacement in place: the next choices name version 2
    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": str(a2), "load_inplace": True},
                   timeout=60)
    assert r.status_code == 200
    stream = client.chat.completions.create(model="a2", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                            stream=True)
    chunks = list(stream)
    assert {c.model for c in chunks} == {"a2"}
    last = [c for c in chunks if c.choices and c.choices[0].finish_reason][-1].choices[0]
    assert (last.model_extra["lora_name"], last.model_extra["lora_version"]) == ("a2", 2)
    body = {"input_ids": [p, p], "lora_path": ["a2", None], "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    outs = httpx.post(url + "/generate", json=body, timeout=60).json()
    assert outs[0]["output_ids"] == peft_reference(FAMILY, a2, p, 4).tokens
    assert outs[1]["output_ids"] == peft_reference(FAMILY, None, p, 4).tokens
    assert (outs[0]["meta_info"]["lora_name"], outs[0]["meta_info"]["lora_version"]) == ("a2", 2)
    assert "lora_name" not in outs[1]["meta_info"]
    r = httpx.post(url + "/unload_lora_adapter", json={"lora_name": "a2"}, timeout=60)
    assert r.status_code == 200 and r.json()["loaded_adapters"] == {"a1": str(a1)}
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="a2", prompt=p, max_tokens=2)


def test_bad_input_is_a_400_naming_the_field(server, files):
    _, a1, a2 = files
    url = server.url

    def error(path, body):
        r = httpx.post(url + path, json=body, timeout=60)
        assert 400 <= r.status_code < 500, r.text
        return r.status_code, r.json()["error"]

    assert error("/v1/load_lora_adapter", {"lora_name": "a1", "lora_path": str(a2)})[1]["param"] == "lora_name"
    assert error("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/nonexistent"})[1]["param"] == "lora_path"
    assert error("/load_lora_adapter", {"lora_name": "y", "lora_path": str(a2), "lora_id": "7"})[1]["param"] == "lora_id"
    assert error("/unload_lora_adapter", {"lora_name": "nope"})[1]["param"] == "lora_name"
    pushed = {"lora_name": "t", "config_dict": {"r": 4}, "serialized_named_tensors": ["eA=="]}
    status, err = error("/load_lora_adapter_from_tensors", pushed)  # CUDA IPC handles: none on a CPU server
    assert status == 400 and err["param"] == "serialized_named_tensors" and "CUDA" in err["message"]
    assert error("/load_lora_adapter_from_tensors", dict(pushed, load_format="flattened_bucket"))[1]["param"] == "load_format"
    assert error("/load_lora_adapter_from_tensors", dict(pushed, added_tokens_config={"x": 1}))[1]["param"] == \
        "added_tokens_config"
    status, err = error("/generate", {"input_ids": [1, 2, 3], "lora_path": "nope"})
    assert status == 400 and err["param"] == "lora_path" and "nope" in err["message"]
    client = openai.OpenAI(base_url=url + "/v1", api_key="x")  # a1 still serves as loaded at start
    p = prompt(9, 4)
    out = client.completions.create(model="a1", prompt=p, max_tokens=4, temperature=0, extra_body={"return_token_ids": True})
    assert out.choices[0].token_ids == peft_reference(FAMILY, a1, p, 4).tokens
    metrics = httpx.get(url + "/metrics", timeout=10).text
    used = [line for line in metrics.splitlines() if line.startswith("r3srv_kv_blocks_used")]
    assert used and float(used[0].split()[-1]) == 0  # nothing leaked


def test_routes_need_enable_lora(files):
    ckpt, a1, _ = files
    with RemoteServer(str(ckpt), "--max-model-len", "64", "--num-kv-blocks", "16", "--device", "cpu") as srv:
        r = httpx.post(srv.url + "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(a1)}, timeout=30)
        assert r.status_code == 404 and "--enable-lora" in r.json()["error"]["message"]


@pytest.mark.gpu("CUDA IPC handles of a trainer on the same GPU")
def test_an_adapter_pushed_from_gpu_memory_serves_as_the_same_adapter_from_disk(files):
    """SGLang's /load_lora_adapter_from_tensors: this process (the trainer) hands over its CUDA
    tensors of a2; the server answers as with a2 read from its directory, token for token and row
    for row, and a checksum that does not match is a 400 naming expected_checksums."""
    import base64
    import hashlib
    import io
    import json

    import torch
    from safetensors.torch import load_file
    from torch.multiprocessing.reductions import ForkingPickler

    ckpt, _, a2 = files
    tensors = {name: t.cuda() for name, t in load_file(str(a2 / "adapter_model.safetensors")).items()}
    buf = io.BytesIO()
    ForkingPickler(buf).dump(tensors)
    sums = {name: hashlib.sha256(t.cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes()).hexdigest()
            for name, t in tensors.items()}
    body = {"lora_name": "pushed", "config_dict": json.loads((a2 / "adapter_config.json").read_text()),
            "serialized_named_tensors": [base64.b64encode(buf.getvalue()).decode()], "expected_checksums": sums}
    args = (str(ckpt), "--enable-lora", "--max-loras", "2", "--max-model-len", "96", "--num-kv-blocks", "64",
            "--lora-modules", f"disk={a2}", "--device", "cuda")
    with RemoteServer(*args) as srv:
        bad = httpx.post(srv.url + "/load_lora_adapter_from_tensors",
                         json=dict(body, expected_checksums=dict(sums, **{next(iter(sums)): "0" * 64})), timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "expected_checksums"
        r = httpx.post(srv.url + "/load_lora_adapter_from_tensors", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["loaded_adapters"] == {"disk": str(a2), "pushed": "__tensor__"}
        p = prompt(9, 4)
        outs = [httpx.post(srv.url + "/generate", json={
            "input_ids": p, "lora_path": name, "return_routed_experts": True,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0}}, timeout=60).json() for name in ("disk", "pushed")]
        assert outs[0]["output_ids"] == outs[1]["output_ids"]
        assert outs[0]["meta_info"]["routed_experts"] == outs[1]["meta_info"]["routed_experts"]
        base = httpx.post(srv.url + "/generate", json={"input_ids": p, "sampling_params": {
            "max_new_tokens": 6, "temperature": 0}}, timeout=60).json()
        assert base["output_ids"] != outs[0]["output_ids"]  # the adapter changed the continuation

