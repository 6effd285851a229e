"""Chat prompts over HTTP carry the template's specials once: a Mixtral-style template writes
`{{ bos_token }}` and its tokenizer also adds one to every encode; a doubled BOS would shift
every token and every routed-experts row by one."""

import base64
import io

import httpx
import numpy as np
import openai
import pytest
from server_fixture import TEST_SERVER_ARGS, RemoteServer
from tiny_checkpoints import BOS_TEMPLATE_ID, make_bos_adding_chat_checkpoint

pytestmark = pytest.mark.slow  # real servers

EXPECTED_CHAT_PROMPT = [BOS_TEMPLATE_ID, *b"[INST] hi [/INST]"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = make_bos_adding_chat_checkpoint(tmp_path_factory.mktemp("bos") / "ckpt")
    with RemoteServer(str(path), "--enable-return-routed-experts", "--max-model-len", "64", *TEST_SERVER_ARGS) as srv:
        yield srv


def test_chat_prompt_has_one_bos_and_rows_to_match(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    model = client.models.list().data[0].id
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2, temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    choice = r.choices[0]
    assert r.model_extra["prompt_token_ids"] == EXPECTED_CHAT_PROMPT  # top level for chat, as in vLLM
    rows = np.load(io.BytesIO(base64.b64decode(choice.model_extra["routed_experts"])))
    assert rows.shape[0] == len(EXPECTED_CHAT_PROMPT) + len(choice.model_extra["token_ids"]) - 1


def test_tokenize_adds_specials_to_prompts_not_to_chats(server):
    chat = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 200, chat.text
    assert chat.json()["tokens"] == EXPECTED_CHAT_PROMPT
    plain = httpx.post(server.url + "/tokenize", json={"prompt": "hi"})
    assert plain.json()["tokens"] == [BOS_TEMPLATE_ID, *b"hi"]
