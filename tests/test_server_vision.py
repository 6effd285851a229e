"""Images over HTTP on a real server (a tiny random Qwen3-VL-MoE checkpoint): SGLang's /generate
with image_data as a data: URI, bare base64 or a file under --allowed-local-media-path, single
and batched; the expanded prompt's tokens and every position's routed experts (decoded as
SGLang-based trainers decode them) equal transformers'; the same image again hits the prefix
cache; files outside the allowed directory, URLs (off by default) and bad images are 400s
naming the field, with nothing held."""

from __future__ import annotations

import base64
import json
import re

import httpx
import numpy as np
import pytest
from server_fixture import TEST_SERVER_ARGS, RemoteServer

from test_engine_vision import picture, text, with_placeholders
from vision_testing import IMAGE_TOKEN, expanded, hf_greedy, image_grids, write_vision_checkpoint

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow  # a real server, transformers oracles

NEW_TOKENS = 4


@pytest.fixture(scope="module", params=["server", "fleet"])
def served(tmp_path_factory, request):
    """One server, and a --data-parallel-size 2 fleet whose one URL must answer the same."""
    topology = ("--data-parallel-size", "2") if request.param == "fleet" else ()
    path = tmp_path_factory.mktemp("qwen3_vl_moe")
    hf, processor = write_vision_checkpoint(transformers, "qwen3_vl_moe", path)
    media = tmp_path_factory.mktemp("media")
    (media / "cat.png").write_bytes(picture(0))
    with RemoteServer(str(path), *topology, "--enable-return-routed-experts", *TEST_SERVER_ARGS, "--dtype", "float32",
                      "--max-model-len", "512", "--allowed-local-media-path", str(media)) as srv:
        srv.model_path = path
        yield srv, hf, processor, media
    assert srv.returncode == 0, srv.log


def generate(server, body: dict) -> httpx.Response:
    return httpx.post(server.url + "/generate", json=body, timeout=300)


def body(ids: list[int], image_data, **extra) -> dict:
    return {"input_ids": ids, "image_data": image_data, "return_routed_experts": True,
            "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}, **extra}


def assert_matches_transformers(out: dict, hf, processor, ids: list[int], images: list[bytes]) -> None:
    """The expanded prompt's length, the greedy tokens and every position's routed experts
    (decoded as slime decodes SGLang's) equal transformers' on the same prompt and images."""
    expected = expanded(ids, images, processor, IMAGE_TOKEN)
    meta = out["meta_info"]
    assert meta["prompt_tokens"] == len(expected)
    assert meta["image_grid_thw"] == image_grids(images, processor)  # with the ids, the input rebuilt
    tokens, _, want = hf_greedy(hf, expected, images, processor, IMAGE_TOKEN, NEW_TOKENS)
    assert out["output_ids"] == tokens
    rows = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype="<i4")
    rows = rows.reshape(len(expected) + NEW_TOKENS - 1, hf.config.text_config.num_hidden_layers, -1)
    for layer, picked in want.items():
        assert np.array_equal(rows[:, layer], picked.numpy()), f"layer {layer}"


def test_image_data_forms_match_transformers_and_share_the_cache(served):
    # through a fleet, each repeat (its ids fill no KV block) reaches the replica holding its image
    srv, hf, processor, media = served
    ids = with_placeholders(text(5, 1), 0, text(4, 2))
    png = picture(0)
    b64 = base64.b64encode(png).decode()
    first = generate(srv, body(ids, f"data:image/png;base64,{b64}"))
    assert first.status_code == 200, first.text
    out = first.json()
    assert_matches_transformers(out, hf, processor, ids, [png])
    for form in (b64, str(media / "cat.png"), f"file://{media / 'cat.png'}", [{"url": f"data:image/png;base64,{b64}"}]):
        again = generate(srv, body(ids, form)).json()
        assert again["output_ids"] == out["output_ids"]
        assert again["meta_info"]["routed_experts"] == out["meta_info"]["routed_experts"]
        assert again["meta_info"]["cached_tokens"] > 0


def test_a_next_turn_with_the_first_turns_image_hits_the_cache(served):
    """A conversation's next turn: the first turn's ids and output, then a new image. Its prompt
    starts with the first turn's blocks, cached where that turn ran; through a fleet, the first
    turn's ids fill no block the front could key, so only its image leads the next turn there."""
    srv, _, _, _ = served
    a, b = (f"data:image/png;base64,{base64.b64encode(picture(case, seed=40 + case)).decode()}" for case in (1, 2))
    ids = with_placeholders(text(3, 31), 0, text(2, 32))
    first = generate(srv, body(ids, [a])).json()
    assert first["meta_info"]["cached_tokens"] == 0  # an image no other test sends
    turn = ids + first["output_ids"] + with_placeholders(text(2, 33), 1)
    second = generate(srv, body(turn, [a, b]))
    assert second.status_code == 200, second.text
    assert second.json()["meta_info"]["cached_tokens"] > 0


def test_a_batch_takes_one_image_list_per_prompt(served):
    srv, hf, processor, _ = served
    ids = [with_placeholders(text(3, 5), 0, text(2, 6)), with_placeholders(0, text(2, 7), 1)]
    images = [[picture(1)], [picture(2), picture(6)]]
    refs = [[f"data:image/png;base64,{base64.b64encode(i).decode()}" for i in group] for group in images]
    outs = generate(srv, body(ids, refs)).json()
    assert len(outs) == 2
    for out, prompt, group in zip(outs, ids, images):
        assert_matches_transformers(out, hf, processor, prompt, group)


@pytest.mark.parametrize("image_data,param,match", [
    ("/etc/hostname.png", "image_data[0]", "not a file under the allowed media directory"),
    ("file:///etc/passwd", "image_data[0]", "not a file under the allowed media directory"),
    ("http://127.0.0.1:1/cat.png", "image_data[0]", "image URLs are off"),
    ("data:text/html;base64,PGh0bWw+", "image_data[0]", "not an image"),
    (base64.b64encode(b"\x89PNG\r\n\x1a\n truncated").decode(), "image_data[0]", "could not be decoded|not an image"),
    ([["a"], ["b"]], "image_data[0]", "must be a string"),  # one prompt's list holds images, not lists
    ({"url": "data:image/png;base64,AAAA", "detail": "high"}, "image_data.detail", "not supported"),
    ({"url": "data:image/png;base64,AAAA", "size": 3}, "image_data", "no field 'size'"),  # SGLang's ImageData has none
])
def test_bad_images_are_400s_naming_the_field(served, image_data, param, match):
    srv, _, _, _ = served
    response = generate(srv, body(with_placeholders(text(3, 9), 0), image_data))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and re.search(match, error["message"]), error
    assert "root:" not in error["message"]  # nothing of the server's files echoed
    used = [line for line in httpx.get(srv.url + "/metrics").text.splitlines() if line.startswith("r3srv_kv_blocks_used")]
    assert used and float(used[0].split()[-1]) == 0


def chat_messages(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "look: "},
                                         {"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": " what is it?"}]}]


def test_chat_image_url_parts_through_the_openai_sdk_match_transformers(served):
    """The openai SDK's chat call with an image_url part: the prompt the checkpoint's own chat
    template renders (transformers' tokenizer), expanded, is the choice's prompt_token_ids; its
    tokens and every position's rows equal transformers'."""
    from openai import OpenAI

    from r3srv.serial import decode_routed_experts

    srv, hf, processor, _ = served
    png = picture(3)
    url = f"data:image/png;base64,{base64.b64encode(png).decode()}"
    client = OpenAI(base_url=srv.url + "/v1", api_key="unused")
    model = client.models.list().data[0].id
    r = client.chat.completions.create(model=model, messages=chat_messages(url), max_tokens=NEW_TOKENS, temperature=0,
                                       extra_body={"return_token_ids": True, "routed_experts_prompt_start": 0,
                                                   "ignore_eos": True})
    choice = r.choices[0]
    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(str(srv.model_path))
    template_messages = [{"role": "user", "content": [{"type": "text", "text": "look: "}, {"type": "image"},
                                                      {"type": "text", "text": " what is it?"}]}]
    text = tokenizer.apply_chat_template(template_messages, add_generation_prompt=True, tokenize=False)
    expected = expanded(tokenizer.encode(text, add_special_tokens=False), [png], processor, IMAGE_TOKEN)
    assert r.model_extra["prompt_token_ids"] == expected  # vLLM's place: the response's
    assert r.model_extra["image_grid_thw"] == image_grids([png], processor)
    tokens, _, want = hf_greedy(hf, expected, [png], processor, IMAGE_TOKEN, NEW_TOKENS)
    assert choice.model_extra["token_ids"] == tokens
    rows = decode_routed_experts(choice.model_extra["routed_experts"])
    assert rows.shape[0] == len(expected) + NEW_TOKENS - 1 == r.usage.prompt_tokens + NEW_TOKENS - 1
    for layer, picked in want.items():
        assert np.array_equal(rows[:, layer], picked.numpy()), f"layer {layer}"


def test_offline_chat_equals_the_servers_chat(served):
    """LLM.chat in this process with the same image_url message: the server's prompt, tokens
    and every position's rows."""
    from r3srv import LLM, SamplingParams
    from r3srv.serial import decode_routed_experts

    srv, _, _, _ = served
    url = f"data:image/png;base64,{base64.b64encode(picture(6)).decode()}"
    r = httpx.post(srv.url + "/v1/chat/completions", timeout=300, json={
        "model": srv.model_path.name, "messages": chat_messages(url), "max_tokens": NEW_TOKENS, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True, "routed_experts_prompt_start": 0})
    assert r.status_code == 200, r.text
    served_out = r.json()
    llm = LLM(str(srv.model_path), dtype="float32", max_model_len=512)
    out = llm.chat(chat_messages(url), SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))[0]
    assert out.prompt_token_ids == served_out["prompt_token_ids"]
    assert out.image_grid_thw == [tuple(g) for g in served_out["image_grid_thw"]]
    assert out.outputs[0].token_ids == served_out["choices"][0]["token_ids"]
    assert np.array_equal(out.outputs[0].routed_experts,
                          decode_routed_experts(served_out["choices"][0]["routed_experts"]))


def test_chat_with_sglang_input_ids_takes_the_messages_images(served):
    """miles' session-server form: the caller's own token ids (one placeholder) with the image as
    an image_url part, and SGLang's meta_info: the placeholder expanded, its rows (int32, as SGLang
    sends them) and tokens equal transformers', each image's grid; streamed, the first chunk
    carries the grid."""
    srv, hf, processor, _ = served
    png = picture(4)
    ids = with_placeholders(text(4, 11), 0, text(3, 12))
    request = {"messages": chat_messages(f"data:image/png;base64,{base64.b64encode(png).decode()}"),
               "input_ids": ids, "return_meta_info": True, "max_tokens": NEW_TOKENS, "temperature": 0,
               "ignore_eos": True, "routed_experts_start_len": 0}
    r = httpx.post(srv.url + "/v1/chat/completions", json={**request, "return_token_ids": True}, timeout=300)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert_matches_transformers({"output_ids": choice["token_ids"], "meta_info": choice["meta_info"]}, hf, processor,
                                ids, [png])
    del request["return_meta_info"]
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json={**request, "stream": True}, timeout=300) as s:
        first = next(line for line in s.iter_lines() if line.startswith("data: {"))
    assert json.loads(first[6:])["image_grid_thw"] == image_grids([png], processor)


def test_continue_final_message_with_an_image_cuts_after_its_text(served):
    """continue_final_message on a message with an image part: the prompt transformers' own
    template renders with continue_final_message (its last text part left open), expanded."""
    srv, _, processor, _ = served
    png = picture(5)
    messages = chat_messages(f"data:image/png;base64,{base64.b64encode(png).decode()}")
    r = httpx.post(srv.url + "/v1/chat/completions", timeout=300, json={
        "messages": messages, "continue_final_message": True, "max_tokens": 2, "return_token_ids": True})
    assert r.status_code == 200, r.text
    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(str(srv.model_path))
    parts = [{"type": "image"} if part["type"] == "image_url" else part for part in messages[0]["content"]]
    text = tokenizer.apply_chat_template([{"role": "user", "content": parts}], continue_final_message=True,
                                         tokenize=False)
    assert r.json()["prompt_token_ids"] == expanded(tokenizer.encode(text, add_special_tokens=False), [png],
                                                    processor, IMAGE_TOKEN)


def test_vllm_token_in_content_parts_match_transformers(served):
    """vLLM's /inference/v1/generate with token_ids (one placeholder) and an image_url content
    part: the expanded prompt_token_ids, vLLM's mm_placeholders, tokens and every position's rows
    (vLLM's .npy) equal transformers'; a stream's first chunk carries the placeholders too."""
    from r3srv.serial import decode_routed_experts

    srv, hf, processor, _ = served
    png = picture(6)
    ids = with_placeholders(text(3, 21), 0, text(5, 22))
    request = {"token_ids": ids, "return_token_ids": True,
               "content_parts": [{"type": "image_url", "url": f"data:image/png;base64,{base64.b64encode(png).decode()}"}],
               "sampling_params": {"max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True,
                                   "routed_experts_prompt_start": 0}}
    r = httpx.post(srv.url + "/inference/v1/generate", json=request, timeout=300)
    assert r.status_code == 200, r.text
    out = r.json()
    expected = expanded(ids, [png], processor, IMAGE_TOKEN)
    assert out["prompt_token_ids"] == expected
    first = expected.index(IMAGE_TOKEN)
    placeholders = {"image": [{"offset": first, "length": expected.count(IMAGE_TOKEN)}]}
    assert out["mm_placeholders"] == placeholders
    tokens, _, want = hf_greedy(hf, expected, [png], processor, IMAGE_TOKEN, NEW_TOKENS)
    assert out["choices"][0]["token_ids"] == tokens
    rows = decode_routed_experts(out["choices"][0]["routed_experts"])
    assert rows.shape[0] == len(expected) + NEW_TOKENS - 1
    for layer, picked in want.items():
        assert np.array_equal(rows[:, layer], picked.numpy()), f"layer {layer}"
    with httpx.stream("POST", srv.url + "/inference/v1/generate", json={**request, "stream": True}, timeout=300) as s:
        chunk = json.loads(next(line for line in s.iter_lines() if line.startswith("data: {"))[6:])
    assert chunk["prompt_token_ids"] == expected and chunk["mm_placeholders"] == placeholders


@pytest.mark.parametrize("parts,param,match", [
    ([{"type": "audio_url", "url": "data:audio/wav;base64,AAAA"}], "content_parts[0]", "only image_url"),
    ([{"type": "image_url", "uuid": "cached-image"}], "content_parts[0].url", "must be a string"),
    ([{"type": "image_url", "url": "file:///etc/passwd"}], "content_parts[0].url", "not a file under"),
])
def test_bad_content_parts_are_400s_naming_the_part(served, parts, param, match):
    srv, _, _, _ = served
    r = httpx.post(srv.url + "/inference/v1/generate", timeout=120, json={
        "token_ids": with_placeholders(text(2, 23), 0), "content_parts": parts, "sampling_params": {"max_tokens": 2}})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and re.search(match, error["message"]), error


@pytest.mark.parametrize("content,param,match", [
    ([{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}], "messages[0].content[0].image_url",
     "not a file under the allowed media directory"),
    ([{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}],
     "messages[0].content[1].image_url", "image URLs are off"),
    ([{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(b"nope").decode()}}],
     "messages[0].content[0].image_url", "not an image|could not be decoded"),
    ([{"type": "video_url", "video_url": {"url": "x"}}], "messages[0].content[0]", "only text and image_url"),
])
def test_bad_chat_images_are_400s_naming_the_part(served, content, param, match):
    srv, _, _, _ = served
    r = httpx.post(srv.url + "/v1/chat/completions", timeout=120,
                   json={"messages": [{"role": "user", "content": content}], "max_tokens": 2})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and re.search(match, error["message"]), error


def test_models_says_image_placeholders_have_rows(served):
    srv, hf, _, _ = served
    info = httpx.get(srv.url + "/v1/models").json()["data"][0]["routed_experts"]
    assert info["images"] == {"image_token_id": IMAGE_TOKEN, "merge_size": hf.config.vision_config.spatial_merge_size,
                              "placeholder_rows": True}
