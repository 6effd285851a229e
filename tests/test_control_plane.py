"""The RL frameworks' control plane on a real server: the attach checks slime and miles make,
miles's weight-update session, SkyRL's world size, sleep mode and collective_rpc weight sync
over vLLM's rendezvous (gloo standing in for NCCL on the CPU), and AReaL's string port.

Each framework's requests are as its client code sends them (the file and line cited at each),
at the commits docs/rl.md names."""

from __future__ import annotations

import contextlib
import json
import subprocess

import httpx
import pytest
import torch.distributed as dist
import weight_sync_trainer as trainer
from server_fixture import TEST_SERVER_ARGS, RemoteServer, free_port, serve_command
from test_server_weights import post
from test_weight_sync import policies, pool  # noqa: F401 (fixtures: the two policies, a thread pool)
from test_weight_sync import PROMPT, reset, served, serves

from r3srv.server.body import decode_body
from r3srv.server.protocol.weight_sync import InitWeightsUpdateGroupRequest

pytestmark = pytest.mark.slow  # real servers

FLAGS = ("--enable-weight-updates", "--enable-return-routed-experts", "--enable-memory-saver",
         "--enable-sleep-mode", "--enable-collective-rpc", "--weight-sync-timeout", "20")


@pytest.fixture(scope="module")
def server(policies):
    with RemoteServer(str(policies[0]), *FLAGS, *TEST_SERVER_ARGS) as srv:
        yield srv
    assert srv.returncode == 0, srv.log


def get(server, route: str, **params) -> httpx.Response:
    return httpx.get(server.url + route, params=params, timeout=120)


def post_query(server, route: str, **params) -> httpx.Response:
    return httpx.post(server.url + route, params=params, timeout=120)


# ---------------------------------------------------------------- attaching (slime, miles)


def miles_expected_server_args(host: str, port: int) -> dict:
    """What miles's _compute_server_args (miles/backends/sglang_utils/sglang_engine.py:696-819, at
    31f1ca9) expects of an external engine at host:port for its defaults with R3 on
    (--rollout-num-gpus-per-engine 1, --num-gpus-per-node 8, --sglang-dp-size/-pp-size/-ep-size 1,
    --offload-rollout, --use-rollout-routing-replay): the fields _init_external compares
    (sglang_engine.py:230-236), all but _EXTERNAL_ENGINE_SKIP_CHECK_FIELDS. base_gpu_id is the
    placement's GPU; a CPU server's is 0."""
    gpus_per_engine, gpus_per_node = 1, 8
    nnodes = max(1, gpus_per_engine // gpus_per_node)
    return {"enable_memory_saver": True, "host": host, "port": port, "nnodes": nnodes, "node_rank": 0 % nnodes,
            "gpu_id_step": 1, "base_gpu_id": 0, "tp_size": gpus_per_engine, "dp_size": 1, "pp_size": 1,
            "ep_size": 1, "enable_return_routed_experts": True}


def test_server_info_passes_miles_and_slimes_attach_checks(server):
    info = get(server, "/get_server_info").json()  # miles reads /get_server_info (sglang_engine.py:226)
    expected = miles_expected_server_args("127.0.0.1", server.port)
    assert {k: info.get(k) for k in expected} == expected
    # slime (slime/backends/sglang_utils/external.py:86-95 reads /server_info first, at 624b824):
    # enable_memory_saver == --offload-rollout, and the R3 flag (sglang_engine.py:569-573)
    slime = get(server, "/server_info").json()
    assert slime["enable_memory_saver"] is True and slime["enable_return_routed_experts"] is True
    assert (slime["tp_size"], slime["pp_size"], slime["ep_size"]) == (1, 1, 1)


def test_enable_memory_saver_reports_the_flag(policies):
    """Without --enable-memory-saver a server says False, whatever else it serves (slime's default
    --offload-rollout is false for an external engine)."""
    with RemoteServer(str(policies[0]), "--enable-weight-updates", *TEST_SERVER_ARGS) as srv:
        info = httpx.get(srv.url + "/server_info").json()
        assert info["enable_memory_saver"] is False and info["port"] == srv.port
        # the development-mode routes are off without their flags, and say which flag
        for route, flag in (("/sleep", "--enable-sleep-mode"), ("/collective_rpc", "--enable-collective-rpc")):
            r = httpx.post(srv.url + route, json={})
            assert r.status_code == 404 and flag in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("flag", ["--enable-sleep-mode", "--enable-collective-rpc"])
def test_development_mode_flags_need_weight_updates(flag):
    done = subprocess.run(serve_command(flag, "--device", "cpu"), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--enable-weight-updates" in done.stderr, done.stderr


# ---------------------------------------------------------------- miles's session


def test_miles_brackets_a_distributed_update_with_begin_and_end(server, policies, pool):
    """miles's update (update_weight_from_distributed/mixin.py:313-331 and sglang_engine.py:573-648):
    pause (retract), GET /flush_cache, /begin_weight_update {selector}, buckets of
    /update_weights_from_distributed (flush_cache false, selector), /update_weight_version,
    /end_weight_update {}, /continue_generation."""
    v0, v1 = policies
    reset(server, v0)
    group = trainer.join(server.url, free_port(), pool)
    try:
        assert post(server, "/pause_generation", {"mode": "retract"}).status_code == 200
        assert httpx.get(server.url + "/flush_cache").status_code == 200
        r = post(server, "/begin_weight_update", {"selector": "all"})
        assert r.status_code == 200 and r.json() == {"success": True, "message": "Success"}, r.text
        tensors = trainer.checkpoint_tensors(v1)
        names = list(tensors)
        for bucket in (names[: len(names) // 2], names[len(names) // 2:]):
            r = trainer.push(server.url, group, {n: tensors[n] for n in bucket}, pool, flush_cache=False,
                             selector="all")
            assert r.status_code == 200, r.text
        r = post(server, "/update_weight_version", {"new_version": "3", "abort_all_requests": False})
        assert r.status_code == 200, r.text
        r = post(server, "/end_weight_update", {})
        assert r.status_code == 200 and r.json()["success"] is True, r.text
        assert post(server, "/continue_generation", {}).status_code == 200
        assert serves(server, v1) and served(server, PROMPT)[2] == "3"
    finally:
        dist.destroy_process_group(group)
        post(server, "/destroy_weights_update_group", {"group_name": trainer.GROUP})


def test_a_session_refuses_what_sglang_refuses_and_a_partial_one_leaves_the_weights(server, policies, pool):
    v0, v1 = policies
    reset(server, v0, version="kept")
    r = post(server, "/end_weight_update", {})
    assert r.status_code == 400 and "begin_weight_update" in r.json()["error"]["message"], r.text
    r = post(server, "/begin_weight_update", {"selector": "draft"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "selector", r.text
    assert post(server, "/begin_weight_update", {}).status_code == 200
    r = post(server, "/begin_weight_update", {})
    assert r.status_code == 400 and "already open" in r.json()["error"]["message"], r.text
    group = trainer.join(server.url, free_port(), pool)
    try:
        tensors = trainer.checkpoint_tensors(v1)
        half = dict(list(tensors.items())[: len(tensors) // 2])
        r = trainer.push(server.url, group, half, pool)
        assert r.status_code == 200 and "staged" in r.json()["message"], r.text
        r = post(server, "/end_weight_update", {})
        assert r.status_code == 400 and "never sent" in r.json()["error"]["message"], r.text
        assert serves(server, v0) and served(server, PROMPT)[2] == "kept"
    finally:
        dist.destroy_process_group(group)
        post(server, "/destroy_weights_update_group", {"group_name": trainer.GROUP})


# ---------------------------------------------------------------- SkyRL


def skyrl_rpc(server, method: str, **kwargs) -> httpx.Response:
    """RemoteInferenceClient's /collective_rpc body (skyrl/backends/skyrl_train/inference_servers/
    remote_inference_client.py:1194-1270, at a956457): {"method", "kwargs"}."""
    body = {"method": method, "kwargs": kwargs} if kwargs else {"method": method}
    return post(server, "/collective_rpc", body)


def test_skyrl_world_size(server):
    # remote_inference_client.py:1377: GET /get_world_size, body {} ; vLLM's include_dp too
    r = httpx.request("GET", server.url + "/get_world_size", json={})
    assert r.json() == {"world_size": 1}
    assert get(server, "/get_world_size", include_dp="false").json() == {"world_size": 1}


def test_skyrl_broadcast_weight_sync_through_collective_rpc(server, policies, pool):
    """SkyRL's NCCL sync (weight_sync/broadcast_strategy.py:159-177 and workers/worker.py:483-506):
    /init_weight_transfer_engine with BroadcastInitInfo.to_api_payload while the trainer opens vLLM's
    rendezvous, then skyrl_start_weight_update, update_weights_nccl {packed: true} while the trainer
    broadcasts vLLM's packed chunks (1 GiB: one chunk here), skyrl_finish_weight_update."""
    v0, v1 = policies
    reset(server, v0)
    world = get(server, "/get_world_size").json()["world_size"] + 1
    # BroadcastInitInfo.to_api_payload (broadcast_strategy.py:68-75): the same four fields
    group = trainer.vllm_join(server.url, free_port(), pool, world_size=world)
    try:
        r = skyrl_rpc(server, "skyrl_start_weight_update", is_checkpoint_format=True)
        assert r.status_code == 200 and r.json() == {"results": [None]}, r.text
        tensors = trainer.checkpoint_tensors(v1)
        update_info = {**trainer.vllm_update_info(tensors), "packed": True}
        reply = pool.submit(skyrl_rpc, server, "update_weights_nccl", update_info=update_info)
        trainer.broadcast_all(group, tensors, packed_bytes=1 << 30)
        assert reply.result().status_code == 200, reply.result().text
        assert serves(server, v0)  # applied at finish only
        assert skyrl_rpc(server, "skyrl_finish_weight_update").status_code == 200
        assert serves(server, v1)
    finally:
        dist.destroy_process_group(group)
        assert post(server, "/shutdown_weight_transfer_engine").status_code == 200


def test_collective_rpc_answers_its_table_only(server, tmp_path):
    r = skyrl_rpc(server, "os.system", command=f"touch {tmp_path / 'ran'}")
    assert r.status_code == 400 and r.json()["error"]["param"] == "method" and not (tmp_path / "ran").exists()
    r = skyrl_rpc(server, "update_weights_ipc", update_info={"ipc_handles_pickled": "gASVAAAAAA=="})
    assert r.status_code == 400 and "never unpickles" in r.json()["error"]["message"], r.text
    r = skyrl_rpc(server, "update_weights_nccl", update_info={"names": []})
    assert r.status_code == 400 and "start_weight_update" in r.json()["error"]["message"], r.text
    r = skyrl_rpc(server, "skyrl_start_weight_update", is_checkpoint_format=False)
    assert r.status_code == 400 and r.json()["error"]["param"] == "kwargs.is_checkpoint_format", r.text
    # fully async SkyRL's allocator calls keep the memory resident on r3srv, and say so by succeeding
    assert skyrl_rpc(server, "skyrl_sleep_for_weight_sync", offload_kv=True).json() == {"results": [None]}
    assert skyrl_rpc(server, "skyrl_wake_for_weight_sync", tags=["weights"]).json() == {"results": [None]}
    r = skyrl_rpc(server, "skyrl_wake_for_weight_sync", tags=["everything"])
    assert r.status_code == 400 and r.json()["error"]["param"] == "kwargs.tags", r.text


def test_collective_rpc_timeout_bounds_the_answer_not_the_call(server, policies, pool):
    """vLLM's `timeout`: the answer is a 400 once it passes; the receive goes on until the trainer's
    stall fails it (--weight-sync-timeout, 20 s here), and the served weights stay."""
    v0, v1 = policies
    reset(server, v0, version="stays")
    group = trainer.vllm_join(server.url, free_port(), pool)
    try:
        assert skyrl_rpc(server, "skyrl_start_weight_update").status_code == 200
        info = trainer.vllm_update_info(trainer.checkpoint_tensors(v1))
        r = post(server, "/collective_rpc", {"method": "update_weights_nccl", "kwargs": {"update_info": info},
                                             "timeout": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "timeout", r.text
        # the receive fails on its own after the server's stall timeout, dropping the group
        r = post(server, "/collective_rpc", {"method": "skyrl_finish_weight_update"})
        assert r.status_code == 400, r.text
        assert serves(server, v0) and served(server, PROMPT)[2] == "stays"
    finally:
        dist.destroy_process_group(group)
        post(server, "/shutdown_weight_transfer_engine")


def test_skyrl_sleep_and_wake_in_two_steps(server, policies, pool):
    """SkyRL's colocated sync (workers/worker_dispatch.py:649-653, client :1023-1058): /sleep?level=2,
    /wake_up?tags=weights, (push), /wake_up?tags=kv_cache. A request sent while asleep waits and
    runs once awake."""
    v0, _ = policies
    reset(server, v0)
    want = served(server, PROMPT)
    r = post_query(server, "/sleep", level="2")
    assert r.status_code == 200 and r.json() == {"status": "sleeping", "level": 2}, r.text
    assert get(server, "/is_sleeping").json() == {"is_sleeping": True}
    assert "r3srv_memory_released{tag=\"weights\"} 1.0" in get(server, "/metrics").text
    waiting = pool.submit(served, server, PROMPT)
    r = post_query(server, "/wake_up", tags=["weights"])
    assert r.json() == {"status": "sleeping", "tags": ["weights"]}, r.text
    assert not waiting.done()
    r = post_query(server, "/wake_up", tags=["kv_cache"])
    assert r.json() == {"status": "awake", "tags": ["kv_cache"]}, r.text
    ids, rows, version = waiting.result(timeout=120)
    assert ids == want[0] and (rows == want[1]).all() and version == want[2]
    assert get(server, "/is_sleeping").json() == {"is_sleeping": False}
    # level 0 pauses only; a wake without tags resumes
    assert post_query(server, "/sleep", level="0").json() == {"status": "sleeping", "level": 0}
    assert get(server, "/is_paused").json()["is_paused"] is True
    assert post_query(server, "/wake_up").json() == {"status": "awake", "tags": None}
    for params, param in (({"level": "3"}, "level"), ({"level": "1", "mode": "keep"}, "mode"),
                          ({"mode": "retract"}, "mode")):
        r = post_query(server, "/sleep", **params)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = post_query(server, "/wake_up", tags=["gpu"])
    assert r.status_code == 400 and r.json()["error"]["param"] == "tags", r.text
    assert get(server, "/is_sleeping").json() == {"is_sleeping": False}


# ---------------------------------------------------------------- AReaL


def test_areal_joins_with_master_port_as_a_string(server, policies, pool):
    """AReaL's /init_weights_update_group (areal/engine/sglang_remote.py:259-269, at 4aef98d) sends
    master_port as str(...), which SGLang's pydantic body coerces."""
    v0, v1 = policies
    reset(server, v0)
    port = free_port()
    body = {"master_address": "127.0.0.1", "master_port": str(port), "rank_offset": 1, "world_size": 2,
            "backend": "gloo", "group_name": trainer.GROUP}
    decoded = decode_body(json.dumps(body).encode(), InitWeightsUpdateGroupRequest, None)
    assert decoded.master_port == port  # the string read as SGLang's pydantic reads it
    reply = pool.submit(post, server, "/init_weights_update_group", body)
    group = dist_group(port)
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(post, server, "/destroy_weights_update_group", {"group_name": trainer.GROUP})
        cleanup.callback(dist.destroy_process_group, group)
        assert reply.result().status_code == 200, reply.result().text
        # areal sglang_remote.py:174-186: the announcement with abort_all_requests, one bucket
        r = trainer.push(server.url, group, trainer.checkpoint_tensors(v1), pool, abort_all_requests=True)
        assert r.status_code == 200, r.text
        assert serves(server, v1)


def dist_group(port: int) -> dist.ProcessGroup:
    return trainer.init_custom_process_group(master_address="127.0.0.1", master_port=port, rank=0, world_size=2,
                                             group_name=trainer.GROUP, backend="gloo", timeout=60)


# ---------------------------------------------------------------- prime-rl's NCCL broadcast


def test_prime_rl_nccl_broadcast_pauses_receives_and_resumes(server, policies, pool, tmp_path):
    """prime-rl with weight_broadcast nccl: /init_broadcaster (trainer.prime_rl_join); each step /pause?mode=keep,
    the NCCL_READY marker in the step's directory, /update_weights {weight_dir} while the trainer
    broadcasts, /resume (client.py:255-315)."""
    v0, v1 = policies
    reset(server, v0)
    group = trainer.prime_rl_join(server.url, free_port(), pool)
    try:
        step = tmp_path / "broadcasts" / "step_1"
        step.mkdir(parents=True)
        assert post_query(server, "/pause", mode="keep", clear_cache="false").json() == {"status": "paused"}
        (step / "NCCL_READY").touch()
        reply = pool.submit(post, server, "/update_weights", {"weight_dir": str(step)})
        trainer.prime_rl_broadcast(group, trainer.checkpoint_tensors(v1))
        assert reply.result().status_code == 200, reply.result().text
        assert post(server, "/resume").json() == {"status": "resumed"}
        assert serves(server, v1) and served(server, PROMPT)[2] == str(step)
    finally:
        dist.destroy_process_group(group)
        post(server, "/destroy_weights_update_group", {"group_name": "prime_rl_broadcast"})
    body = {"host": "127.0.0.1", "port": free_port(), "rank_offset": 0, "inference_world_size": 1,
            "quantize_in_weight_transfer": True}
    r = post(server, "/init_broadcaster", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "quantize_in_weight_transfer", r.text
