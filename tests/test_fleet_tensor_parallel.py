"""`r3srv serve --data-parallel-size 2 --tensor-parallel-size 2 --enable-expert-parallel` on the
CPU: two replicas of two ranks each behind the fleet's front; a completion through the front and
straight from each replica gives one device's greedy tokens and routed experts."""

from __future__ import annotations

import numpy as np
import pytest
from server_fixture import RemoteServer
from test_fleet import complete, get, replica_urls
from tiny_checkpoints import write_tiny_checkpoint

from r3srv import LLM, SamplingParams
from r3srv.serial import decode_routed_experts

pytestmark = pytest.mark.slow  # real servers, worker processes

ENGINE = dict(num_kv_blocks=32, max_num_seqs=2, max_model_len=128)
PROMPT = "Each replica spans two ranks."


def test_replicas_of_two_expert_parallel_ranks_serve_one_devices_tokens_and_rows(tmp_path):
    path = str(write_tiny_checkpoint(tmp_path / "ckpt", "qwen3_moe"))
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    want = LLM(path, dtype="float32", **ENGINE).generate([PROMPT], params)[0].outputs[0]
    engine_flags = [x for k, v in ENGINE.items() for x in ("--" + k.replace("_", "-"), str(v))]
    srv = RemoteServer(path, "-dp", "2", "-tp", "2", "--enable-expert-parallel", "--device", "cpu", "--dtype", "float32",
                       "--enable-return-routed-experts", *engine_flags, "--log-level", "warning")
    try:
        replicas = replica_urls(srv.url)
        assert get(srv.url + "/server_info")["dp_size"] == 2
        for url in replicas:  # each replica holds two ranks, expert parallel
            info = get(url + "/server_info")
            assert (info["tp_size"], info["ep_size"], info["dp_size"]) == (2, 2, 1)
        for url in [srv.url, *replicas]:
            choice = complete(url, PROMPT, max_tokens=5)["choices"][0]
            assert choice["token_ids"] == list(want.token_ids), url
            np.testing.assert_array_equal(decode_routed_experts(choice["routed_experts"]), want.routed_experts)
    finally:
        srv.stop()
