"""Weight updates of a vision-language model reach its vision tower, and drop the encoder
cache: two tiny random Qwen3-VL-MoE checkpoints (different seeds, so different towers and
language models); after an update from disk (offline and a real server's
/update_weights_from_disk) or tensors pushed by name (the trainers' road, TrainerUpdates: the
language model's and the tower's tensors in separate calls, or the tower's alone) the same
image prompt's tokens, logprobs and every position's rows equal transformers' with the new
weights. An image encoded before the update is encoded again (a stale encoder output would be
a silent wrong answer). Tower tensors the tower cannot take are refused before anything changes."""

from __future__ import annotations

import asyncio
import base64
import copy

import httpx
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from server_fixture import TEST_SERVER_ARGS, RemoteServer

from r3srv import LLM
from r3srv.errors import InvalidRequestError
from test_engine_vision import (NEW_TOKENS, assert_matches_transformers, greedy, picture, text,
                                with_placeholders)
from vision_testing import IMAGE_TOKEN, expanded, hf_greedy, write_vision_checkpoint

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow  # transformers oracles, a real server

ENGINE = dict(block_size=4, num_kv_blocks=256, max_model_len=512)
VISUAL = "model.visual."


@pytest.fixture(scope="module")
def policies(tmp_path_factory):
    root = tmp_path_factory.mktemp("vision_policies")
    v0 = write_vision_checkpoint(transformers, "qwen3_vl_moe", root / "v0", seed=7)
    v1 = write_vision_checkpoint(transformers, "qwen3_vl_moe", root / "v1", seed=8)
    return (root / "v0", *v0), (root / "v1", *v1)


def prompt(png: bytes) -> dict:
    return {"prompt_token_ids": with_placeholders(text(4, 1), 0, text(3, 2)), "multi_modal_data": {"image": png}}


def tensors_of(path) -> dict:
    return load_file(str(path / "model.safetensors"))


def push(llm: LLM, tensors: dict) -> str:
    return asyncio.run(llm.trainer_updates().take(tensors))


def test_update_from_disk_replaces_the_tower_and_encodes_images_again(policies):
    (v0, hf0, processor), (v1, hf1, _) = policies
    llm = LLM(str(v0), **ENGINE)
    png = picture(1)
    before = llm.generate(prompt(png), greedy())[0]
    assert_matches_transformers(before, hf0, processor, [png])
    encoder = llm.engine.runner.encoder
    encoded = encoder.images_encoded
    llm.update_weights(str(v1))
    after = llm.generate(prompt(png), greedy())[0]
    assert encoder.images_encoded == encoded + 1  # the cached output of the old tower was dropped
    assert_matches_transformers(after, hf1, processor, [png])


def test_pushed_tensors_update_the_tower_in_any_order_and_alone(policies):
    (v0, hf0, processor), (v1, hf1, _) = policies
    new = tensors_of(v1)
    tower = {n: t for n, t in new.items() if n.startswith(VISUAL)}
    language = {n: t for n, t in new.items() if not n.startswith(VISUAL)}
    assert tower and language
    png = picture(2)

    llm = LLM(str(v0), **ENGINE)
    llm.generate(prompt(png), greedy())  # the image in the encoder cache, of v0's tower
    assert push(llm, tower).startswith("updated")  # the tower alone: v0's language model, v1's tower
    mixed = copy.deepcopy(hf0)
    result = mixed.load_state_dict({n: t for n, t in tower.items()}, strict=False)
    assert not result.unexpected_keys
    assert_matches_transformers(llm.generate(prompt(png), greedy())[0], mixed, processor, [png])

    llm = LLM(str(v0), **ENGINE)
    llm.generate(prompt(png), greedy())
    assert push(llm, language).startswith("updated")  # a trainer's buckets: the language model first
    assert push(llm, tower).startswith("updated")
    assert_matches_transformers(llm.generate(prompt(png), greedy())[0], hf1, processor, [png])


def test_tower_tensors_it_cannot_take_are_refused_and_change_nothing(policies):
    (v0, hf0, processor), (v1, _, _) = policies
    tower = {n: t for n, t in tensors_of(v1).items() if n.startswith(VISUAL)}
    name = sorted(tower)[0]
    llm = LLM(str(v0), **ENGINE)
    for bad, match in [({name: tower[name].unsqueeze(0)}, "has shape"),
                       ({VISUAL + "no_such.weight": tower[name]}, "no tensor named"),
                       ({name: tower[name].to(dtype=torch.int32)}, "not a floating-point")]:
        with pytest.raises(InvalidRequestError, match=match) as exc:
            push(llm, bad)
        assert exc.value.param == "names"
    part = dict(list(tower.items())[:3])  # part of the tower: staged until the rest arrives
    assert "applied once" in push(llm, part)
    asyncio.run(llm.trainer_updates().sync.drop_staged())
    png = picture(3)
    assert_matches_transformers(llm.generate(prompt(png), greedy())[0], hf0, processor, [png])


def test_server_update_weights_from_disk_reaches_the_tower(policies):
    (v0, hf0, processor), (v1, hf1, _) = policies
    png = picture(5)
    ids = with_placeholders(text(4, 1), 0, text(3, 2))
    body = {"input_ids": ids, "image_data": base64.b64encode(png).decode(), "return_routed_experts": True,
            "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}}
    expected = expanded(ids, [png], processor, IMAGE_TOKEN)

    def assert_served_by(out: dict, hf) -> None:
        tokens, _, want = hf_greedy(hf, expected, [png], processor, IMAGE_TOKEN, NEW_TOKENS)
        assert out["output_ids"] == tokens
        rows = np.frombuffer(base64.b64decode(out["meta_info"]["routed_experts"]), dtype="<i4")
        rows = rows.reshape(len(expected) + NEW_TOKENS - 1, hf.config.text_config.num_hidden_layers, -1)
        for layer, picked in want.items():
            assert np.array_equal(rows[:, layer], picked.numpy()), f"layer {layer}"

    with RemoteServer(str(v0), "--enable-weight-updates", "--enable-return-routed-experts", "--dtype", "float32",
                      "--max-model-len", "512", *TEST_SERVER_ARGS) as srv:
        assert_served_by(httpx.post(srv.url + "/generate", json=body, timeout=300).json(), hf0)
        r = httpx.post(srv.url + "/update_weights_from_disk", json={"model_path": str(v1)}, timeout=300)
        assert r.status_code == 200 and r.json()["success"], r.text
        assert_served_by(httpx.post(srv.url + "/generate", json=body, timeout=300).json(), hf1)
    assert srv.returncode == 0, srv.log
