"""slime's and miles' rollout through a 2-replica fleet (`r3srv serve --data-parallel-size 2`, the
SGLang router in front), as those frameworks route: /generate through the router, aborts sent to
each worker the router lists (miles/rollout/sglang_rollout.py:399-408 at
radixark/miles@31f1ca961a94cb860cec3b2dea34ec332bfa8f76). Kept apart from test_rl_clients.py so
the fleet's front can be re-pointed without touching the single-server tests."""

from __future__ import annotations

import time

import httpx
import numpy as np
import pytest

from server_fixture import RemoteServer
from test_rl_clients import PROMPT, int32_rows, slime_sampling_params
from tiny_checkpoints import write_tiny_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.peer]  # a fleet of real servers behind the real sglang-router

pytest.importorskip("sglang_router", reason="the fleet needs sglang-router (pip install 'r3srv[router]')")

FLEET = ("--data-parallel-size", "2", "--enable-return-routed-experts", "--enable-weight-updates", "--device", "cpu",
         "--num-kv-blocks", "64", "--max-num-seqs", "8", "--max-model-len", "128", "--log-level", "warning")


def workers(url: str) -> list[str]:
    """The router's healthy workers, as miles lists them (GET /workers)."""
    try:
        listed = httpx.get(url + "/workers", timeout=5).json()["workers"]
    except (httpx.HTTPError, ValueError, KeyError):
        return []
    return sorted(w["url"] for w in listed if w["is_healthy"])


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    checkpoint = write_tiny_checkpoint(tmp_path_factory.mktemp("rl-fleet") / "policy", "qwen3_moe", seed=0)
    with RemoteServer(str(checkpoint), *FLEET, startup_timeout=600) as srv:
        deadline = time.monotonic() + 180
        while len(workers(srv.url)) < 2:
            assert time.monotonic() < deadline, f"the router never had 2 healthy workers:\n{srv.log}"
            time.sleep(0.5)
        yield srv


def test_slime_rollout_and_miles_abort_through_the_router(fleet):
    with httpx.Client(base_url=fleet.url, timeout=180) as http:
        # the layout from a worker: the router answers /v1/models itself, without r3srv's routed_experts
        info = httpx.get(workers(fleet.url)[0] + "/v1/models", timeout=30).json()["data"][0]["routed_experts"]
        body = {"sampling_params": slime_sampling_params(5), "return_logprob": True, "return_routed_experts": True,
                "input_ids": PROMPT}
        first = http.post("/generate", json=body)
        assert first.status_code == 200, first.text
        meta = first.json()["meta_info"]
        assert "routed_experts" in meta, f"the router's answer lost them: {sorted(meta)}"
        output = [item[1] for item in meta["output_token_logprobs"]]
        rows = int32_rows(meta["routed_experts"])
        assert rows.size == (len(PROMPT) + len(output) - 1) * info["num_layers"] * info["top_k"]
        again = http.post("/generate", json=body).json()["meta_info"]  # greedy: either replica, the same rows
        assert np.array_equal(int32_rows(again["routed_experts"]), rows)
        for url in workers(fleet.url):
            assert httpx.post(url + "/abort_request", json={"abort_all": True}, timeout=30).status_code == 200
