"""A server started WITHOUT --enable-return-routed-experts: no rows by default, and asking is a clear 400."""

from __future__ import annotations

import httpx
import openai
import pytest
from server_fixture import TEST_SERVER_ARGS, RemoteServer

pytestmark = pytest.mark.slow  # real servers


@pytest.fixture(scope="module")
def offload_hold(tmp_path_factory):
    """While this file exists, the server's offloaded work (a long prompt's tokenization) waits
    (tests/gated_serve.py)."""
    return tmp_path_factory.mktemp("offload") / "hold"


@pytest.fixture(scope="module")
def server(gate, offload_hold):
    with RemoteServer("--served-model-name", "plain", *TEST_SERVER_ARGS, step_gate=gate,
                      env={"R3SRV_TEST_HOLD_OFFLOADED": str(offload_hold)}) as srv:
        yield srv
    assert srv.returncode == 0, f"SIGTERM should stop the server cleanly:\n{srv.log}"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_models_has_no_routed_experts_layout(server):
    card = httpx.get(server.url + "/v1/models").json()["data"][0]
    assert card["id"] == "plain"  # --served-model-name
    assert "routed_experts" not in card and "weight_version" not in card


def test_default_response_has_no_routed_experts(client):
    r = client.completions.create(model="plain", prompt="hello", max_tokens=2, extra_body={"return_token_ids": True})
    assert r.choices[0].routed_experts is None
    assert "weight_version" not in r.choices[0].model_extra  # weights never change on this server
    assert len(r.choices[0].token_ids) == 2


@pytest.mark.parametrize("api", ["completions", "chat", "generate"])
def test_asking_for_routed_experts_says_how_to_start_the_server(server, client, api):
    if api == "generate":
        r = httpx.post(
            server.url + "/inference/v1/generate",
            json={"token_ids": [1, 2], "sampling_params": {"max_tokens": 1, "return_routed_experts": True}},
        )
        assert r.status_code == 400
        message = r.json()["error"]["message"]
    else:
        with pytest.raises(openai.BadRequestError) as exc:
            if api == "completions":
                client.completions.create(model="plain", prompt="hi", max_tokens=1, extra_body={"return_routed_experts": True})
            else:
                client.chat.completions.create(
                    model="plain", messages=[{"role": "user", "content": "hi"}], extra_body={"return_routed_experts": True}
                )
        message = exc.value.message
    assert "--enable-return-routed-experts" in message


def test_other_model_names_are_not_found(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="r3srv-builtin-random-moe", prompt="hi", max_tokens=1)


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_the_loop_keeps_serving_while_a_huge_prompt_is_tokenized(server, offload_hold, api):
    """A 2.4M-character prompt (then 400: too long for max_model_len) is tokenized off the event
    loop: /health answers while its tokenization is held in flight (by the hold, not by its
    length), which a tokenization on the loop would block until the hold is lifted."""
    import threading
    import time

    text = "hello world " * 200_000
    path, body = (
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}], "max_tokens": 4})
        if api == "chat"
        else ("/v1/completions", {"prompt": text, "max_tokens": 4})
    )
    entered = offload_hold.with_name(offload_hold.name + ".entered")
    entered.unlink(missing_ok=True)
    result: dict = {}

    def big_request() -> None:
        result["response"] = httpx.post(server.url + path, json=body, timeout=120)

    offload_hold.touch()
    worker = threading.Thread(target=big_request)
    try:
        worker.start()
        deadline = time.monotonic() + 60
        while not entered.exists():  # the request arrived and its tokenization is held
            assert worker.is_alive() and time.monotonic() < deadline, "the prompt's tokenization never started"
            time.sleep(0.01)
        health = httpx.get(server.url + "/health", timeout=30)  # on a loop held by the tokenizer: a timeout
        assert health.status_code == 200 and worker.is_alive() and "response" not in result
    finally:
        offload_hold.unlink(missing_ok=True)
        worker.join()
    response = result["response"]
    assert response.status_code == 400 and "max_model_len" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    "path", ["/update_weights_from_disk", "/reset_prefix_cache", "/release_memory_occupation", "/resume_memory_occupation",
             "/pause_generation", "/continue_generation", "/flush_cache", "/destroy_weights_update_group", "/pause",
             "/resume", "/update_weights", "/start_weight_update", "/finish_weight_update",
             "/shutdown_weight_transfer_engine"]
)
def test_weight_update_endpoints_are_off_without_their_flag(server, path):
    r = httpx.post(server.url + path, json={"model_path": "/tmp"})
    assert r.status_code == 404
    assert "--enable-weight-updates" in r.json()["error"]["message"]
