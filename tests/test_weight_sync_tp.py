"""A trainer pushing a new policy over torch.distributed (gloo) into a tensor-parallel engine
(TP=2: the trainer is rank 0, the engine's ranks join as 1 and 2 of 3, as in SGLang and vLLM).

Every rank receives each broadcast in full and loads its own shard; afterwards the TP=2
engine's greedy tokens and routed experts equal one device's loaded from the pushed
checkpoint on disk. Offline (LLM(tensor_parallel_size=2)) and over HTTP
(`r3srv serve --tensor-parallel-size 2`); bad ranks are refused before anyone waits, and a
trainer that dies mid-push leaves the old weights on every rank."""

from __future__ import annotations

import multiprocessing

import httpx
import numpy as np
import pytest
import weight_sync_trainer as trainer
from server_fixture import TEST_SERVER_ARGS, RemoteServer, free_port
from test_server_weights import ENGINE, offline, post, served
from test_weight_sync import policies, pool  # noqa: F401 (fixtures: the two policies, a thread pool)

from engine_testing import GREEDY, prompt_ids
from r3srv import LLM, SamplingParams
from r3srv.errors import InvalidRequestError
from r3srv.models.staged_shards import ShardPieces

pytestmark = [pytest.mark.slow, pytest.mark.peer]  # real servers; the trainers' weight-update calls

PROMPT = prompt_ids(20, base=3)
WORLD = 3  # the trainer and two tensor-parallel ranks
TP2 = ("--tensor-parallel-size", "2", "--dtype", "float32")


@pytest.fixture(scope="module")
def oracle(policies):
    """One device's greedy tokens and routed experts, each policy loaded from disk."""
    return {path: offline(path, PROMPT) for path in policies}


def same(got, want) -> bool:
    return got[0] == want[0] and np.array_equal(got[1], want[1])


def spawn(target, *args) -> multiprocessing.Process:
    proc = multiprocessing.get_context("spawn").Process(target=target, args=args, daemon=True)
    proc.start()
    return proc


# ---------------------------------------------------------------- offline
def generated(llm: LLM):
    out = llm.generate([PROMPT], SamplingParams(max_tokens=8, **GREEDY))[0].outputs[0]
    return out.token_ids, out.routed_experts


def test_offline_tp2_engine_takes_a_pushed_policy_and_survives_a_dying_trainer(policies, oracle):
    v0, v1 = policies
    # both trainers start first (each hosts its rendezvous and waits there), while the engine loads
    # (free_port() keeps their ports bound meanwhile; the engine's ranks meet on a port of their own)
    port, dying_port = free_port(), free_port()
    pusher = spawn(trainer.broadcast_checkpoint, port, WORLD, v1)
    dying = spawn(trainer.broadcast_checkpoint, dying_port, WORLD, v0, 3)
    llm = LLM(str(v0), tensor_parallel_size=2, dtype="float32", **ENGINE)
    try:
        assert same(generated(llm), oracle[v0])
        announced = trainer.announce(trainer.checkpoint_tensors(v1))
        names, dtypes, shapes = announced["names"], announced["dtypes"], announced["shapes"]
        # world_size must count the trainer and both ranks: refused before anyone waits
        for ranks, param in (((1, 2), "world_size"), ((0, 3), "rank_offset"), ((3, 3), "rank_offset")):
            with pytest.raises(InvalidRequestError) as refused:
                llm.init_weights_update_group("127.0.0.1", free_port(), *ranks)
            assert refused.value.param == param

        joined = llm.init_weights_update_group("127.0.0.1", port, rank_offset=1, world_size=WORLD, timeout=30)
        assert "ranks 1..2 of 3" in joined
        half = len(names) // 2
        message = llm.update_weights_from_distributed(names[:half], dtypes[:half], shapes[:half])
        assert "staged" in message and same(generated(llm), oracle[v0])
        # Rank 0 staged only its shard of each split tensor, read as the loader will read it.
        staged = llm.engine.core.executor.ranks.weight_sync.staged
        kept = {name: sum(p.numel() for p in t.pieces.values()) / t.shape.numel()
                for name, t in staged.items() if isinstance(t, ShardPieces)}
        assert kept and max(kept.values()) <= 0.51, kept  # half of each (a padded vocabulary's rows rounded up)
        message = llm.update_weights_from_distributed(names[half:], dtypes[half:], shapes[half:],
                                                      weight_version="step-1")
        pusher.join(60)
        assert pusher.exitcode == 0 and "updated" in message and not llm.engine.core.executor.ranks.weight_sync.staged
        assert same(generated(llm), oracle[v1])
        llm.destroy_weights_update_group()

        # A trainer dying mid-push: every rank drops what it got and the group; v1 stays.
        llm.init_weights_update_group("127.0.0.1", dying_port, rank_offset=1, world_size=WORLD, timeout=10)
        with pytest.raises(InvalidRequestError) as failed:
            llm.update_weights_from_distributed(names, dtypes, shapes)
        dying.join(60)
        assert dying.exitcode == 3 and failed.value.param == "names"
        assert same(generated(llm), oracle[v1])
        with pytest.raises(InvalidRequestError) as gone:  # destroyed on every rank
            llm.destroy_weights_update_group()
        assert gone.value.param == "group_name"
    finally:
        llm.shutdown()


def test_offline_single_device_engine_takes_the_same_calls(policies, oracle):
    """The offline API at one device (the server's own receiver, driven from the caller's thread)."""
    v0, v1 = policies
    port = free_port()
    pusher = spawn(trainer.broadcast_checkpoint, port, 2, v1)
    llm = LLM(str(v0), **ENGINE)
    assert "as rank 1 of 2" in llm.init_weights_update_group("127.0.0.1", port, rank_offset=1, world_size=2)
    announced = trainer.announce(trainer.checkpoint_tensors(v1))
    message = llm.update_weights_from_distributed(announced["names"], announced["dtypes"], announced["shapes"])
    pusher.join(60)
    assert pusher.exitcode == 0 and "updated" in message
    assert same(generated(llm), oracle[v1])
    llm.destroy_weights_update_group()


# ---------------------------------------------------------------- over HTTP
@pytest.fixture(scope="module")
def server(policies):
    args = (str(policies[0]), *TP2, "--enable-weight-updates", "--enable-return-routed-experts",
            "--enable-collective-rpc", "--weight-sync-timeout", "10")
    with RemoteServer(*args, *TEST_SERVER_ARGS) as srv:
        yield srv
    assert srv.returncode == 0, srv.log


def serves(server, want) -> bool:
    ids, rows, _ = served(server, PROMPT)
    return ids == want[0] and np.array_equal(rows, want[1])


def test_a_policy_pushed_into_a_tp2_server_serves_as_one_device_loaded_from_disk(server, policies, oracle, pool):
    v0, v1 = policies
    assert serves(server, oracle[v0])
    body = dict(master_address="127.0.0.1", master_port=free_port(), group_name=trainer.GROUP, backend="gloo")
    for ranks, param in (((1, 2), "world_size"), ((0, 3), "rank_offset")):
        r = post(server, "/init_weights_update_group", dict(body, rank_offset=ranks[0], world_size=ranks[1]))
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text

    group = trainer.join(server.url, free_port(), pool, world_size=WORLD)
    try:
        tensors = trainer.checkpoint_tensors(v1)
        names = list(tensors)
        first, rest = names[: len(names) // 2], names[len(names) // 2:]
        r = trainer.push(server.url, group, {n: tensors[n] for n in first}, pool, weight_version="step-1")
        assert r.status_code == 200 and "staged" in r.json()["message"], r.text
        assert serves(server, oracle[v0])  # half a policy is staged on both ranks, not served
        r = trainer.push(server.url, group, {n: tensors[n] for n in rest}, pool, weight_version="step-1")
        assert r.status_code == 200 and "updated" in r.json()["message"], r.text
        assert serves(server, oracle[v1]) and served(server, PROMPT)[2] == "step-1"
    finally:
        trainer.dist.destroy_process_group(group)
        assert post(server, "/destroy_weights_update_group", {"group_name": trainer.GROUP}).status_code == 200


def test_a_trainer_dying_mid_push_leaves_the_old_weights_on_every_rank(server, policies, oracle):
    v0, v1 = policies
    r = post(server, "/update_weights_from_disk", {"model_path": str(v0), "weight_version": "old"})
    assert r.status_code == 200, r.text
    dying = spawn(trainer.push_then_die, server.url, free_port(), v1, 3, WORLD)
    dying.join(120)
    assert dying.exitcode == 3
    # The server notices the dead peer, drops what it received and the group with it.
    r = trainer.group_dropped(server.url)
    assert r.status_code == 400 and r.json()["error"]["param"] == "group_name", r.text
    assert httpx.get(server.url + "/health").status_code == 200
    assert serves(server, oracle[v0]) and served(server, PROMPT)[2] == "old"


def test_vllm_weight_transfer_under_tp_ranks_its_workers_the_same_way(server, policies, oracle, pool):
    v0, v1 = policies
    r = post(server, "/update_weights_from_disk", {"model_path": str(v0)})
    assert r.status_code == 200, r.text
    group = trainer.vllm_join(server.url, free_port(), pool, world_size=WORLD)
    try:
        assert post(server, "/start_weight_update").status_code == 200
        r = trainer.vllm_push(server.url, group, trainer.checkpoint_tensors(v1), pool)
        assert r.status_code == 200, r.text
        assert serves(server, oracle[v0])  # applied at /finish_weight_update only
        r = post(server, "/finish_weight_update", {"weight_version": "vllm-1"})
        assert r.status_code == 200, r.text
        assert serves(server, oracle[v1]) and served(server, PROMPT)[2] == "vllm-1"
    finally:
        trainer.dist.destroy_process_group(group)
        assert post(server, "/shutdown_weight_transfer_engine").status_code == 200


def test_skyrl_and_prime_rl_pushes_reach_every_tp_rank(server, policies, oracle, pool, tmp_path):
    """SkyRL's collective_rpc round (packed, 64 KiB chunks) and prime-rl's broadcaster, each over
    vLLM's rendezvous: both ranks join (as 1 and 2 of 3), receive every chunk and keep their shard."""
    v0, v1 = policies
    assert post(server, "/update_weights_from_disk", {"model_path": str(v0)}).status_code == 200
    assert httpx.get(server.url + "/get_world_size").json() == {"world_size": 2}
    group = trainer.vllm_join(server.url, free_port(), pool, world_size=WORLD)
    try:
        rpc = {"method": "skyrl_start_weight_update", "kwargs": {"is_checkpoint_format": True}}
        assert post(server, "/collective_rpc", rpc).json() == {"results": [None, None]}
        tensors = trainer.checkpoint_tensors(v1)
        info = {**trainer.vllm_update_info(tensors), "packed": True, "packed_buffer_size_bytes": 1 << 16}
        reply = pool.submit(post, server, "/collective_rpc", {"method": "update_weights_nccl",
                                                              "kwargs": {"update_info": info}})
        trainer.broadcast_all(group, tensors, packed_bytes=1 << 16)
        assert reply.result().status_code == 200, reply.result().text
        assert post(server, "/collective_rpc", {"method": "skyrl_finish_weight_update"}).status_code == 200
        assert serves(server, oracle[v1])
    finally:
        trainer.dist.destroy_process_group(group)
        assert post(server, "/shutdown_weight_transfer_engine").status_code == 200
    group = trainer.prime_rl_join(server.url, free_port(), pool, inference_world_size=2)
    try:
        (tmp_path / "NCCL_READY").touch()
        reply = pool.submit(post, server, "/update_weights", {"weight_dir": str(tmp_path)})
        trainer.prime_rl_broadcast(group, trainer.checkpoint_tensors(v0))
        assert reply.result().status_code == 200, reply.result().text
        assert serves(server, oracle[v0]) and served(server, PROMPT)[2] == str(tmp_path)
    finally:
        trainer.dist.destroy_process_group(group)
        assert post(server, "/destroy_weights_update_group", {"group_name": "prime_rl_broadcast"}).status_code == 200
