"""A test "trainer": rank 0 of a gloo group with an r3srv server, pushing a checkpoint's tensors
the way SGLang trainers (slime, miles, AReaL) do: the HTTP call announcing the tensors runs in a
thread while this process broadcasts them, in order, from rank 0."""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import datetime
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from server_fixture import free_port

from r3srv.engine.process_groups import group_on_store
from r3srv.engine.vllm_transfer import UNIQUE_ID_KEY, gloo_group_name
from r3srv.engine.weight_sync import init_custom_process_group

GROUP = "weight_update_group"


def checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(Path(path).glob("*.safetensors")):
        tensors |= load_file(shard)
    return tensors


def post(url: str, route: str, body: dict) -> httpx.Response:
    return httpx.post(url + route, json=body, timeout=120)


def join(url: str, port: int, pool: concurrent.futures.Executor, group_name: str = GROUP,
         world_size: int = 2) -> dist.ProcessGroup:
    """The server joins as rank 1 (its tensor-parallel ranks as 1..world_size-1) while this
    process hosts the rendezvous as rank 0."""
    body = dict(master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=world_size,
                group_name=group_name, backend="gloo")
    reply = pool.submit(post, url, "/init_weights_update_group", body)
    group = init_custom_process_group(master_address="127.0.0.1", master_port=port, rank=0, world_size=world_size,
                                      group_name=group_name, backend="gloo", timeout=60)
    response = reply.result()
    assert response.status_code == 200, response.text
    return group


@contextlib.contextmanager
def joined(url: str, pool: concurrent.futures.Executor, world_size: int = 2) -> Iterator[dist.ProcessGroup]:
    """A gloo group of this process (the trainer, rank 0) and the server at `url` (its
    tensor-parallel ranks as 1..world_size-1), torn down after."""
    group = join(url, free_port(), pool, world_size=world_size)
    try:
        yield group
    finally:
        dist.destroy_process_group(group)
        post(url, "/destroy_weights_update_group", {"group_name": GROUP})


def vllm_init_info(port: int, world_size: int = 2) -> dict:
    return {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": world_size}


VLLM_UNIQUE_ID = base64.b64decode(
    json.loads((Path(__file__).parent / "data" / "vllm_transfer.json").read_text())["unique_id_pickle_b64"])


def vllm_trainer_group(port: int, world_size: int) -> dist.ProcessGroup:
    """vLLM's trainer side of its NCCL weight transfer (NCCLWeightTransferEngine.trainer_init), on
    the CPU: rank 0 of a StatelessProcessGroup, so the host of a plain TCPStore that waits for every
    member, its ncclUniqueId pickled at broadcast_from/0/0 (the bytes vLLM's class pickles to), then
    the communicator's one-float warm-up all-reduce; the communicator is gloo on the same store,
    r3srv's CPU stand-in for NCCL."""
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=True, timeout=datetime.timedelta(seconds=60),
                          use_libuv=False)
    store.set(UNIQUE_ID_KEY, VLLM_UNIQUE_ID)
    group = group_on_store(store, rank=0, world_size=world_size, group_name=gloo_group_name(port), backend="gloo",
                           timeout=60)
    dist.all_reduce(torch.zeros(1, dtype=torch.float32), group=group)
    return group


def vllm_join(url: str, port: int, pool: concurrent.futures.Executor, world_size: int = 2,
              **packing) -> dist.ProcessGroup:
    """vLLM's names: /init_weight_transfer_engine while this process opens vLLM's rendezvous as rank 0
    (`packing`: init_info's packed, packed_buffer_size_bytes, ...)."""
    reply = pool.submit(post, url, "/init_weight_transfer_engine",
                        {"init_info": vllm_init_info(port, world_size) | packing})
    group = vllm_trainer_group(port, world_size)
    response = reply.result()
    assert response.status_code == 200, response.text
    return group


def vllm_packed(tensors: dict[str, torch.Tensor], buffer_size_bytes: int) -> list[torch.Tensor]:
    """The trainer's packed broadcasts, as vLLM's producer makes them: each tensor's bytes
    appended to the chunk, which is sent once it holds more than buffer_size_bytes."""
    chunks, chunk, size = [], [], 0
    for tensor in tensors.values():
        flat = tensor.contiguous().view(-1).view(torch.uint8)
        chunk.append(flat)
        size += flat.numel()
        if size > buffer_size_bytes:
            chunks.append(torch.cat(chunk))
            chunk, size = [], 0
    if chunk:
        chunks.append(torch.cat(chunk))
    return chunks


def broadcast_all(group: dist.ProcessGroup, tensors: dict[str, torch.Tensor], packed_bytes: int | None = None) -> None:
    """One broadcast per tensor, or vLLM's packed chunks of `packed_bytes`."""
    sent = tensors.values() if packed_bytes is None else vllm_packed(tensors, packed_bytes)
    for tensor in sent:
        dist.broadcast(tensor.contiguous(), src=0, group=group)


def vllm_update_info(tensors: dict[str, torch.Tensor]) -> dict:
    body = announce(tensors)
    return {"names": body["names"], "dtype_names": body["dtypes"], "shapes": body["shapes"]}


def vllm_push(url: str, group: dist.ProcessGroup, tensors: dict[str, torch.Tensor],
              pool: concurrent.futures.Executor, packed_bytes: int | None = None) -> httpx.Response:
    """One vLLM /update_weights {update_info} call and its broadcasts (inside a start/finish round)."""
    reply = pool.submit(post, url, "/update_weights", {"update_info": vllm_update_info(tensors)})
    broadcast_all(group, tensors, packed_bytes)
    return reply.result()


def announce(tensors: dict[str, torch.Tensor], **extra) -> dict:
    return dict(names=list(tensors), dtypes=[str(t.dtype).removeprefix("torch.") for t in tensors.values()],
                shapes=[list(t.shape) for t in tensors.values()], group_name=GROUP, **extra)


def push(url: str, group: dist.ProcessGroup, tensors: dict[str, torch.Tensor], pool: concurrent.futures.Executor,
         *, die_after: int | None = None, route: str = "/update_weights_from_distributed", **extra) -> httpx.Response:
    """One /update_weights_from_distributed call (or `route`'s: an adapter's push) and its
    broadcasts; with die_after, the process exits (as a crashed trainer) after broadcasting
    that many tensors."""
    reply = pool.submit(post, url, route, announce(tensors, **extra))
    handles = []
    for i, tensor in enumerate(tensors.values()):
        if die_after is not None and i == die_after:
            for handle in handles:
                handle.wait()
            os._exit(3)
        handles.append(dist.broadcast(tensor.contiguous(), src=0, group=group, async_op=True))
    for handle in handles:
        handle.wait()
    return reply.result()


def group_dropped(url: str, seconds: float = 30.0) -> httpx.Response:
    """After a trainer died: the server's answer to an announcement once it has noticed the dead
    peer and dropped the group (or the last answer, when `seconds` ran out)."""
    deadline = time.monotonic() + seconds
    while True:
        r = post(url, "/update_weights_from_distributed", announce({}))
        if "no weight update group" in r.text or time.monotonic() > deadline:
            return r
        time.sleep(0.2)


def push_then_die(url: str, port: int, checkpoint: Path, die_after: int, world_size: int = 2) -> None:
    """Run in a process of its own: join, announce the whole checkpoint, broadcast a few tensors, die."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        group = join(url, port, pool, world_size=world_size)
        push(url, group, checkpoint_tensors(checkpoint), pool, die_after=die_after)


def broadcast_checkpoint(port: int, world_size: int, checkpoint: Path, die_after: int | None = None) -> None:
    """Run in a process of its own, for an offline engine that joins and announces by itself:
    host the rendezvous as rank 0, then broadcast the checkpoint's tensors in checkpoint_tensors'
    order (with die_after, exit 3 after that many, as a crashed trainer)."""
    group = init_custom_process_group(master_address="127.0.0.1", master_port=port, rank=0, world_size=world_size,
                                      group_name=GROUP, backend="gloo", timeout=60)
    for i, tensor in enumerate(checkpoint_tensors(checkpoint).values()):
        if i == die_after:
            os._exit(3)
        dist.broadcast(tensor.contiguous(), src=0, group=group)
    dist.destroy_process_group(group)


def prime_rl_broadcast(group: dist.ProcessGroup, tensors: dict[str, torch.Tensor], layer_prefix: str = "model.layers.") -> None:
    """prime-rl's trainer push (src/prime_rl/transports/weights/nccl.py:27-67 and :140-161, at 559b447):
    the number of state dicts, then the non-layer weights and each layer's, each as its metadata's
    size, the metadata ({dtype: [(name, shape, numel)]} pickled) and one concatenated tensor per dtype."""
    import pickle

    layers = sorted({int(n[len(layer_prefix):].split(".")[0]) for n in tensors if n.startswith(layer_prefix)})
    dicts = [{n: t for n, t in tensors.items() if not n.startswith(layer_prefix)}]
    dicts += [{n: t for n, t in tensors.items() if n.startswith(f"{layer_prefix}{i}.")} for i in layers]
    dist.broadcast(torch.tensor([len(dicts)], dtype=torch.long), src=0, group=group)
    for state in dicts:
        by_dtype: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
        for name, tensor in state.items():
            by_dtype.setdefault(tensor.dtype, []).append((name, tensor))
        metadata = pickle.dumps({d: [(n, t.shape, t.numel()) for n, t in items] for d, items in by_dtype.items()})
        dist.broadcast(torch.tensor([len(metadata)], dtype=torch.long), src=0, group=group)
        dist.broadcast(torch.ByteTensor(list(metadata)), src=0, group=group)
        for items in by_dtype.values():
            dist.broadcast(torch.cat([t.flatten() for _, t in items]), src=0, group=group)


def prime_rl_join(url: str, port: int, pool: concurrent.futures.Executor, inference_world_size: int = 1,
                  **extra) -> dist.ProcessGroup:
    """prime-rl's orchestrator's /init_broadcaster (src/prime_rl/utils/client.py:418-433) for one
    server (rank_offset 0) while this process, the trainer, opens vLLM's rendezvous as rank 0 of
    inference_world_size + 1 (transports/weights/nccl.py:128-134)."""
    body = {"host": "127.0.0.1", "port": port, "rank_offset": 0, "inference_world_size": inference_world_size,
            "timeout": 60, "quantize_in_weight_transfer": False} | extra
    reply = pool.submit(post, url, "/init_broadcaster", body)
    group = vllm_trainer_group(port, inference_world_size + 1)
    response = reply.result()
    assert response.status_code == 200 and response.json() == {"status": "ok"}, response.text
    return group
