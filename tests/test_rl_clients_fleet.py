"""slime's and miles' rollout through a 2-replica fleet's one URL (`r3srv serve
--data-parallel-size 2`, r3srv's own front), as those frameworks route: /generate through the
router address they are given, then the end-of-rollout abort sent to each worker the router lists
(miles/rollout/sglang_rollout.py:399-408 at radixark/miles@31f1ca961a94cb860cec3b2dea34ec332bfa8f76:
GET /workers, then POST {url}/abort_request {"abort_all": true} to each). The front lists itself as
the one worker, so miles' abort reaches every replica. Kept apart from test_rl_clients.py so the
fleet's front can be re-pointed without touching the single-server tests."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from server_fixture import RemoteServer
from test_fleet import replica_urls
from test_rl_clients import PROMPT, int32_rows, slime_sampling_params
from tiny_checkpoints import write_tiny_checkpoint

pytestmark = pytest.mark.slow  # a fleet of real servers

FLEET = ("--data-parallel-size", "2", "--enable-return-routed-experts", "--enable-weight-updates", "--device", "cpu",
         "--num-kv-blocks", "64", "--max-num-seqs", "8", "--max-model-len", "128", "--log-level", "warning")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    checkpoint = write_tiny_checkpoint(tmp_path_factory.mktemp("rl-fleet") / "policy", "qwen3_moe", seed=0)
    with RemoteServer(str(checkpoint), *FLEET, startup_timeout=600) as srv:
        yield srv


def test_slime_rollout_with_offsets_and_miles_abort_through_the_fleet(fleet):
    with httpx.Client(base_url=fleet.url, timeout=180) as http:
        info = http.get("/v1/models").json()["data"][0]["routed_experts"]  # the layout, from the fleet's URL
        body = {"sampling_params": slime_sampling_params(5), "return_logprob": True, "return_routed_experts": True,
                "input_ids": PROMPT}
        first = http.post("/generate", json=body)
        assert first.status_code == 200, first.text
        meta = first.json()["meta_info"]
        output = [item[1] for item in meta["output_token_logprobs"]]
        rows = int32_rows(meta["routed_experts"])
        assert rows.size == (len(PROMPT) + len(output) - 1) * info["num_layers"] * info["top_k"]
        again = http.post("/generate", json=body).json()["meta_info"]  # greedy: either replica, the same rows
        assert np.array_equal(int32_rows(again["routed_experts"]), rows)
        # slime's next turn: the rows it holds are skipped, the echo says so
        start = len(PROMPT) - 2
        turn = http.post("/generate", json={**body, "routed_experts_start_len": start}).json()["meta_info"]
        assert turn["routed_experts_start_len"] == start
        assert np.array_equal(int32_rows(turn["routed_experts"]), rows.reshape(-1)[start * info["num_layers"]
                                                                                    * info["top_k"]:])
        # miles' abort: the router's worker list, then /abort_request to each worker listed
        listed = [w["url"] for w in http.get("/workers").json()["workers"] if w["is_healthy"]]
        assert listed == [fleet.url]
        assert http.get("/list_workers").json() == {"urls": [fleet.url]}
        for url in listed:
            assert httpx.post(url + "/abort_request", json={"abort_all": True}, timeout=30).status_code == 200
        assert len(replica_urls(fleet.url)) == 2
