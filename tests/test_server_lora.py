"""LoRA over HTTP: vLLM's and SGLang's load/unload routes, an adapter selected by `model` (the
openai SDK) and by `lora_path` on SGLang's /generate, /v1/models listing it with its parent,
start-up flags, and bad input answered with OpenAI-shaped 4xx, the adapter kept."""

from __future__ import annotations

import httpx
import openai
import pytest
from lora_testing import peft_reference, prompt, write_adapter, write_checkpoint
from server_fixture import RemoteServer

pytestmark = pytest.mark.slow  # a real server, PEFT oracles

FAMILY = "qwen3_moe"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_server")
    ckpt = write_checkpoint(root / "ckpt", FAMILY)
    return ckpt, write_adapter(root / "a1", FAMILY, seed=1), write_adapter(root / "a2", FAMILY, seed=2)


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
    body = {"input_ids": [p, p], "lora_path": ["a2", None], "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    outs = httpx.post(url + "/generate", json=body, timeout=60).json()
    assert outs[0]["output_ids"] == peft_reference(FAMILY, a2, p, 4).tokens
    assert outs[1]["output_ids"] == peft_reference(FAMILY, None, p, 4).tokens
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
    status, err = error("/generate", {"input_ids": [1, 2, 3], "lora_path": "nope"})
    assert status == 400 and err["param"] == "lora_name"
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
