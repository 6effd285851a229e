"""`r3srv serve --batch-invariant`, tried as a user would: the same completion sent alone, sent
again (over the prefix cache), and sent among concurrent others answers the same text, logprobs
and routed_experts payload, byte for byte."""

import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from server_fixture import TEST_SERVER_ARGS, RemoteServer

pytestmark = pytest.mark.slow  # a real server

PROMPT = "Rollouts replay the routing of every token"


@pytest.fixture(scope="module")
def server():
    with RemoteServer("--batch-invariant", "--enable-return-routed-experts", "--max-num-batched-tokens", "24",
                      *TEST_SERVER_ARGS) as srv:
        yield srv
    assert srv.returncode == 0, srv.log


def complete(server, prompt: str, max_tokens: int = 8) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "logprobs": 2}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return {"text": choice["text"], "logprobs": choice["logprobs"], "rows": choice["routed_experts"]}


def test_same_answer_alone_again_and_among_others(server):
    alone = complete(server, PROMPT)
    assert alone["rows"] and alone["logprobs"]["token_logprobs"]
    assert complete(server, PROMPT) == alone  # over the prefix cache
    rng = random.Random(4)
    others = ["".join(chr(rng.randrange(97, 123)) for _ in range(rng.randint(3, 70))) for _ in range(8)]
    with ThreadPoolExecutor(9) as pool:
        futures = [pool.submit(complete, server, p, rng.randint(1, 12)) for p in others[:4]]
        target = pool.submit(complete, server, PROMPT)
        futures += [pool.submit(complete, server, p, rng.randint(1, 12)) for p in others[4:]]
        assert target.result() == alone
        for f in futures:
            f.result()
