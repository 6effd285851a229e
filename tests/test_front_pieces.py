"""The fleet front's pieces without processes: the prefix-aware choice, each replica's rank in a
trainer's group, one answer from many, the summed /metrics (prometheus_client's own parser as the
oracle), and the replicas' command lines."""

from __future__ import annotations

import base64
import hashlib
import io
import itertools
import socket

import msgspec
import numpy as np
import pytest
import torch
from PIL import Image
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from server_fixture import free_port

from r3srv.cli import build_parser
from r3srv.data_parallel import replica_argv, replica_devices, supervisor_headers
from r3srv.engine.multiproc_executor import Rendezvous, host_store, rank_device
from r3srv.errors import ConfigError
from r3srv.front.app import RankError, declared_fleet, declared_ranks, rank_bodies
from r3srv.front.discovery import fleet_world_size, sum_prometheus
from r3srv.front.images import image_digests, image_references
from r3srv.front.policy import BALANCE_ABS, BLOCK_CHARS, PrefixAwarePolicy, prompt_key
from r3srv.security import ServeSecurity
from r3srv.server.declare import Fleet, Ranks
from r3srv.server.fanout import UNREACHABLE, Reply, combine
from r3srv.server.routes import ROUTE_HANDLERS
from r3srv.vision.media import MediaPolicy

# ------------------------------------------------------------------ which replica


@pytest.mark.parametrize("body, key", [
    ({"prompt": "abc"}, ("text", "abc")),
    ({"prompt": [5, 6, 7]}, ("ids", [5, 6, 7])),
    ({"prompt": [[5, 6], [7]]}, ("ids", [5, 6])),
    ({"prompt": ["first", "second"]}, ("text", "first")),
    ({"token_ids": [1, 2], "sampling_params": {}}, ("ids", [1, 2])),
    ({"input_ids": [[3, 4]]}, ("ids", [3, 4])),
    ({"text": "hi"}, ("text", "hi")),
    ({"messages": [{"role": "user", "content": "x"}]}, ("chat", '{"role":"user","content":"x"}')),
    ({"prompt": [[[[[["deep"]]]]]]}, None),
    ({"model": "m"}, None),
    ([1, 2], None),
    ({"prompt": []}, None),
    ({"prompt": [True, False]}, None),
])
def test_prompt_key_reads_each_dialects_prompt(body, key):
    assert prompt_key(body) == key


def test_a_conversations_next_turn_goes_where_its_prefix_is():
    rng = np.random.default_rng(0)
    policy = PrefixAwarePolicy(3, block_tokens=16)
    loads = [0, 0, 0]
    turns = {c: rng.integers(0, 1000, size=40).tolist() for c in range(6)}
    served = {}
    for c, prompt in turns.items():
        hashes = policy.block_hashes(("ids", prompt))
        served[c] = policy.choose(hashes, [0, 1, 2], loads)
        policy.record(hashes, served[c])
        loads[served[c]] += 1  # still running: the next conversation goes elsewhere
    assert sorted(set(served.values())) == [0, 1, 2]  # no shared prefix: spread by load
    for c, prompt in turns.items():
        longer = prompt + rng.integers(0, 1000, size=30).tolist()
        assert policy.choose(policy.block_hashes(("ids", longer)), [0, 1, 2], loads) == served[c]
    # a prefix shorter than a block matches nothing
    assert policy.block_hashes(("ids", turns[0][:15])) == []
    text = "y" * (2 * BLOCK_CHARS + 5)
    assert len(policy.block_hashes(("text", text))) == 2


def test_balance_wins_over_the_cache_when_one_replica_is_far_busier():
    policy = PrefixAwarePolicy(2, block_tokens=4)
    hashes = policy.block_hashes(("ids", list(range(8))))
    policy.record(hashes, 0)
    assert policy.choose(hashes, [0, 1], [BALANCE_ABS, 0]) == 0  # within the slack: the cache
    assert policy.choose(hashes, [0, 1], [BALANCE_ABS + 1, 0]) == 1  # beyond it: the idle one
    assert policy.choose(hashes, [1], [0, 0]) == 1  # the holder is down
    policy.forget(0)  # it restarted with an empty cache
    assert policy.choose(hashes, [0, 1], [3, 1]) == 1


def test_a_chained_hash_matches_whole_prefixes_only():
    policy = PrefixAwarePolicy(2, block_tokens=2)
    policy.record(policy.block_hashes(("ids", [1, 2, 3, 4])), 0)
    # the same second block after a different first one is not a match
    assert policy.choose(policy.block_hashes(("ids", [9, 9, 3, 4])), [0, 1], [1, 0]) == 1
    assert policy.choose(policy.block_hashes(("ids", [1, 2, 8, 8])), [0, 1], [1, 0]) == 0


def _png(seed: int) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(buffer, "PNG")
    return buffer.getvalue()


def _image_bodies(png: bytes, media_dir) -> list[dict]:
    """One short prompt with one image, in every form and dialect a client sends it."""
    (media_dir / "cat.png").write_bytes(png)
    b64 = base64.b64encode(png).decode()
    uri = f"data:image/png;base64,{b64}"
    sglang = [{"input_ids": [1, 2, 3], "image_data": form}
              for form in (uri, b64, str(media_dir / "cat.png"), f"file://{media_dir / 'cat.png'}", [{"url": uri}],
                           [[uri]])]
    batch = {"input_ids": [[1, 2, 3], [4]], "image_data": [uri, None]}
    chat = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}},
                                                      {"type": "text", "text": "hi"}]}]}
    tito = {"token_ids": [1, 2, 3], "content_parts": [{"type": "image_url", "url": uri}]}
    miles = {"input_ids": [1, 2, 3], **chat}  # SGLang's chat extension: ids beside the messages' images
    return [*sglang, batch, chat, tito, miles]


def test_an_image_is_keyed_by_its_bytes_in_every_form(tmp_path):
    media = MediaPolicy(allowed_local_path=tmp_path)
    png = _png(0)
    keys = {image_digests(image_references(b), media)[0] for b in _image_bodies(png, tmp_path)}
    assert keys == {hashlib.sha256(b"bytes:" + png).digest()}
    (tmp_path / "other").mkdir()
    other = {image_digests(image_references(b), media)[0] for b in _image_bodies(_png(1), tmp_path / "other")}
    assert len(other) == 1 and other != keys
    # without the media flag the front reads no file: the path is keyed by its text, as the replica refuses it
    assert image_digests([(str(tmp_path / "cat.png"), True)], MediaPolicy()) != image_digests(
        [(f"data:image/png;base64,{base64.b64encode(_png(1)).decode()}", False)], MediaPolicy())
    assert image_digests([("https://example.com/cat.png", False)], media) == image_digests(
        [("https://example.com/cat.png", False)], media)
    # images in prompt order; text-only prompts have none
    two = {"input_ids": [1], "image_data": [f"data:image/png;base64,{base64.b64encode(_png(s)).decode()}" for s in (3, 4)]}
    assert image_digests(image_references(two), media) == [hashlib.sha256(b"bytes:" + _png(s)).digest() for s in (3, 4)]
    for text_only in ({"prompt": "x"}, {"input_ids": [1]}, {"messages": [{"role": "user", "content": "x"}]}, [1]):
        assert image_references(text_only) == []


def test_a_chat_keys_its_images_apart_from_its_text(tmp_path):
    text = [{"role": "user", "content": [{"type": "text", "text": "hi " * 30}]}]
    assert prompt_key({"messages": text}) == ("chat", msgspec.json.encode(text[0]).decode())  # unchanged
    body = _image_bodies(_png(0), tmp_path)[-3]
    other = _image_bodies(_png(1), tmp_path)[-3]
    # the URL (here a whole PNG) is not part of the text: the text blocks stay few
    assert prompt_key(body) == prompt_key(other) and "base64" not in prompt_key(body)[1]


def test_a_short_image_prompt_goes_where_its_images_are():
    policy = PrefixAwarePolicy(2, block_tokens=16)
    short = policy.block_hashes(("ids", [1, 2, 3]))
    assert short == []  # its ids fill no block before the replica expands the placeholder
    cat, dog = hashlib.sha256(b"cat").digest(), hashlib.sha256(b"dog").digest()
    assert policy.image_hashes([]) == []
    assert policy.image_hashes([cat]) != policy.image_hashes([dog])
    first = policy.choose(short, [0, 1], [0, 0], policy.image_hashes([cat]))
    policy.record(short + policy.image_hashes([cat]), first)
    # the repeat goes there even while that replica is a little busier; another image goes to the idlest
    busy = [0, 0]
    busy[first] = 2
    assert policy.choose(short, [0, 1], busy, policy.image_hashes([cat])) == first
    assert policy.choose(short, [0, 1], busy, policy.image_hashes([dog])) == 1 - first
    # a next turn: longer ids, the same image and a new one after it
    assert policy.choose(policy.block_hashes(("ids", list(range(40)))), [0, 1], busy,
                         policy.image_hashes([cat, dog])) == first
    # an image first sent in a later turn: the text blocks before it still match
    turn = policy.block_hashes(("ids", list(range(100, 140))))
    policy.record(turn, 1 - first)
    assert policy.choose(policy.block_hashes(("ids", list(range(100, 160)))), [0, 1], [0, 0],
                         policy.image_hashes([dog])) == 1 - first


# ------------------------------------------------------------------ ranks in the trainer's group


@pytest.mark.parametrize("replicas, tp", [(2, 1), (3, 2)])
def test_each_replica_joins_with_its_own_rank_offset(replicas, tp):
    sglang = {"master_address": "a", "master_port": "29500", "rank_offset": "1", "world_size": 1 + replicas * tp,
              "group_name": "g", "backend": "gloo"}
    vllm = {"init_info": {"master_address": "a", "master_port": 1, "rank_offset": 1, "world_size": 1 + replicas * tp}}
    for body, holder in ((sglang, lambda d: d), (vllm, lambda d: d["init_info"])):
        out = [msgspec.json.decode(b) for b in rank_bodies(msgspec.json.encode(body), replicas, tp)]
        assert [holder(d)["rank_offset"] for d in out] == [1 + i * tp for i in range(replicas)]
        for d in out:  # everything else as the trainer sent it
            assert {k: v for k, v in holder(d).items() if k != "rank_offset"} == \
                   {k: v for k, v in holder(body).items() if k != "rank_offset"}


def test_a_world_too_small_for_every_replica_is_refused_before_anyone_joins():
    body = msgspec.json.encode({"rank_offset": 1, "world_size": 2, "master_port": 1})
    with pytest.raises(RankError, match="at least 3") as exc:
        rank_bodies(body, 2, 1)
    assert exc.value.param == "world_size"
    with pytest.raises(RankError) as exc:
        rank_bodies(msgspec.json.encode({"rank_offset": 0, "world_size": 9}), 2, 1)
    assert exc.value.param == "rank_offset"
    # prime-rl's offsets count inference ranks only (its /init_broadcaster declares Ranks(...))
    prime = Ranks(world="inference_world_size", lowest_offset=0)
    body = {"host": "a", "port": 1, "rank_offset": 0, "inference_world_size": 4}
    out = [msgspec.json.decode(b) for b in rank_bodies(msgspec.json.encode(body), 2, 2, prime)]
    assert [d["rank_offset"] for d in out] == [0, 2] and {d["inference_world_size"] for d in out} == {4}
    with pytest.raises(RankError, match="at least 4") as exc:
        rank_bodies(msgspec.json.encode({**body, "inference_world_size": 3}), 2, 2, prime)
    assert exc.value.param == "inference_world_size"
    assert declared_ranks(ROUTE_HANDLERS)["/init_broadcaster"] == prime
    assert declared_ranks(ROUTE_HANDLERS)["/init_weights_update_group"] == Ranks()
    # nothing to move: the same body for every replica (each answers for itself)
    for plain in (b'{"names": []}', b"", b"not json", b'{"rank_offset": "x"}'):
        assert rank_bodies(plain, 2, 1) == [plain, plain]


def test_every_declared_path_has_a_fleet_behaviour():
    fleet = declared_fleet(ROUTE_HANDLERS)
    assert fleet["/pause_generation"] is Fleet.EVERY_REPLICA and fleet["/v1/completions"] is Fleet.ONE_REPLICA
    assert fleet["/init_weights_update_group"] is Fleet.OWN_RANK
    assert set(fleet) == {p for h in ROUTE_HANDLERS for p in h.paths}


# ------------------------------------------------------------------ one answer from many


def _error(status: int, message: str, param: str | None = None) -> bytes:
    return msgspec.json.encode({"error": {"message": message, "type": "x", "param": param, "code": status}})


def test_one_answer_from_every_replica():
    ok = [Reply(f"replica {i}", 200, b'{"success":true}', [(b"content-type", b"application/json")]) for i in range(2)]
    assert combine("/p", ok) == (200, ok[0].headers, ok[0].body)
    same = [Reply(f"replica {i}", 400, _error(400, "bad model_path", "model_path")) for i in range(2)]
    assert combine("/p", same)[0::2] == (400, same[0].body)  # all alike: that answer, param and all
    status, _, body = combine("/p", [ok[0], Reply("replica 1", UNREACHABLE, error="ConnectError")], " (note)")
    error = msgspec.json.decode(body)["error"]
    assert status == 502 and "applied on replica 0" in error["message"] and "replica 1: unreachable" in error["message"]
    assert error["message"].endswith("(note)")
    status, _, body = combine("/p", [ok[0], Reply("replica 1", 409, _error(409, "busy", "mode"))])
    assert status == 409 and msgspec.json.decode(body)["error"]["param"] == "mode"


@pytest.mark.parametrize("query, want", [("", 4), ("include_dp=true", 4), ("include_dp=false", 2),
                                         ("include_dp=0", 2), ("include_dp=False", 2)])
def test_the_fleets_world_size_adds_its_replicas_ranks(query, want):
    """Two replicas of tensor-parallel size 2: vLLM counts dp * tp, SkyRL sizes its group by it."""
    replies = [Reply(f"replica {i}", 200, b'{"world_size":2}', [(b"content-type", b"application/json")])
               for i in range(2)]
    status, _, body = fleet_world_size("/get_world_size", query, replies)
    assert status == 200 and msgspec.json.decode(body) == {"world_size": want}
    down = fleet_world_size("/get_world_size", query, [replies[0], Reply("replica 1", UNREACHABLE, error="x")])
    assert down[0] == 502  # not a world that leaves a replica out
    refused = [Reply(f"replica {i}", 400, _error(400, "bad include_dp", "include_dp")) for i in range(2)]
    assert fleet_world_size("/get_world_size", "include_dp=maybe", refused)[0::2] == (400, refused[0].body)


# ------------------------------------------------------------------ /metrics summed


def _exposition(seed: int) -> str:
    rng = np.random.default_rng(seed)
    registry = CollectorRegistry()
    requests = Counter("r3srv_requests", "requests", ["route", "status"], registry=registry)
    used = Gauge("r3srv_kv_blocks_used", "blocks", registry=registry)
    latency = Histogram("r3srv_latency_seconds", "latency", ["route"], buckets=(0.1, 1.0), registry=registry)
    routes = ["/a", "/b", f"/only-{seed}"]  # a series only this replica has
    for route, status in itertools.product(routes, ["200", "400"]):
        requests.labels(route, status).inc(int(rng.integers(0, 5)))
    used.set(float(rng.integers(0, 100)))
    for value in rng.random(5) * 2:
        latency.labels(routes[0]).observe(value)
    return generate_latest(registry).decode()


def _samples(text: str) -> dict[tuple, float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_the_fleets_metrics_are_the_replicas_summed():
    texts = [_exposition(seed) for seed in range(3)]
    merged = sum_prometheus(texts)
    want: dict[tuple, float] = {}
    for text in texts:
        for key, value in _samples(text).items():
            if key[0].endswith("_created"):
                want[key] = min(want.get(key, value), value)
            else:
                want[key] = want.get(key, 0.0) + value
    assert _samples(merged) == pytest.approx(want)
    families = [f.name for f in text_string_to_metric_families(merged)]
    assert len(families) == len(set(families))  # each family whole, once


# ------------------------------------------------------------------ the replicas' command lines


def test_replica_argv_passes_every_flag_on_and_sets_its_own_place():
    parser = build_parser()
    args = parser.parse_args(["serve", "m", "-dp", "2", "--port", "9", "--no-enable-prefix-caching",
                              "--enable-weight-updates", "--max-num-seqs", "4", "--served-model-name", "x",
                              "--fleet-peer-urls", "http://other-node:8000"])
    argv = replica_argv(parser, args, model="/new", port=123, device="cuda:1", weight_version="v7", served_model_name="x")
    child = parser.parse_args(argv[3:])
    assert (child.model, child.port, child.host, child.device, child.data_parallel_size) == ("/new", 123, "127.0.0.1", "cuda:1", 1)
    assert child.fleet_peer_urls is None and child.weight_version == "v7"  # the front fans out, not the replicas
    same = ("enable_prefix_caching", "enable_weight_updates", "max_num_seqs", "served_model_name", "log_level", "seed")
    assert {k: getattr(child, k) for k in same} == {k: getattr(args, k) for k in same}
    assert supervisor_headers(ServeSecurity.from_args(args, {})) == {}  # keys: tests/test_auth.py


def test_replicas_with_tensor_parallel_ranks_take_consecutive_devices():
    parser = build_parser()
    args = parser.parse_args(["serve", "m", "-dp", "2", "-tp", "2", "--enable-expert-parallel", "--device", "cpu"])
    assert replica_devices(args.device, 2, args.tensor_parallel_size) == ["cpu", "cpu"]
    child = parser.parse_args(replica_argv(parser, args, model="m", port=1, device="cuda:2", weight_version="v")[3:])
    assert (child.tensor_parallel_size, child.enable_expert_parallel, child.data_parallel_size) == (2, True, 1)
    assert child.master_port == 0  # each replica's ranks meet on a free port of their own
    rendezvous = Rendezvous(world_size=2)
    assert [rank_device(child.device, r, rendezvous) for r in range(2)] == [torch.device("cuda", 2), torch.device("cuda", 3)]
    assert rank_device("cuda", 1, rendezvous) == torch.device("cuda", 1)
    if not torch.cuda.is_available() or torch.cuda.device_count() < 4:
        with pytest.raises(ConfigError, match="needs 4 CUDA devices"):
            replica_devices("cuda", 2, 2)


def test_rank_zero_hosts_a_listening_store_before_the_workers_learn_its_port():
    rendezvous, store = host_store(Rendezvous(world_size=2))
    assert rendezvous.master_port == store.port != 0
    with socket.create_connection(("127.0.0.1", rendezvous.master_port), timeout=5):
        pass  # already listening: no port is picked, freed and bound again later
    port = free_port()  # held by this process (bound, not listening): the store binds it all the same
    named, named_store = host_store(Rendezvous(world_size=2, master_port=port))
    assert named.master_port == named_store.port == port  # --master-port: bound as named
    with pytest.raises(ConfigError, match="--master-port is required"):
        host_store(Rendezvous(world_size=2, nnodes=2))
