"""A test "trainer": rank 0 of a gloo group with an r3srv server, pushing a checkpoint's tensors
the way SGLang trainers (slime, miles, AReaL) do: the HTTP call announcing the tensors runs in a
thread while this process broadcasts them, in order, from rank 0."""

from __future__ import annotations

import concurrent.futures
import os
import time
from pathlib import Path

import httpx
import torch
import torch.distributed as dist
from safetensors.torch import load_file

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


def vllm_init_info(port: int, world_size: int = 2) -> dict:
    return {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": world_size}


def vllm_join(url: str, port: int, pool: concurrent.futures.Executor, world_size: int = 2) -> dist.ProcessGroup:
    """vLLM's names: /init_weight_transfer_engine while this process hosts the rendezvous as rank 0."""
    reply = pool.submit(post, url, "/init_weight_transfer_engine", {"init_info": vllm_init_info(port, world_size)})
    group = init_custom_process_group(master_address="127.0.0.1", master_port=port, rank=0, world_size=world_size,
                                      group_name=GROUP, backend="gloo", timeout=60)
    response = reply.result()
    assert response.status_code == 200, response.text
    return group


def vllm_update_info(tensors: dict[str, torch.Tensor]) -> dict:
    body = announce(tensors)
    return {"names": body["names"], "dtype_names": body["dtypes"], "shapes": body["shapes"]}


def vllm_push(url: str, group: dist.ProcessGroup, tensors: dict[str, torch.Tensor],
              pool: concurrent.futures.Executor) -> httpx.Response:
    """One vLLM /update_weights {update_info} call and its broadcasts (inside a start/finish round)."""
    reply = pool.submit(post, url, "/update_weights", {"update_info": vllm_update_info(tensors)})
    for tensor in tensors.values():
        dist.broadcast(tensor.contiguous(), src=0, group=group)
    return reply.result()


def announce(tensors: dict[str, torch.Tensor], **extra) -> dict:
    return dict(names=list(tensors), dtypes=[str(t.dtype).removeprefix("torch.") for t in tensors.values()],
                shapes=[list(t.shape) for t in tensors.values()], group_name=GROUP, **extra)


def push(url: str, group: dist.ProcessGroup, tensors: dict[str, torch.Tensor], pool: concurrent.futures.Executor,
         *, die_after: int | None = None, **extra) -> httpx.Response:
    """One /update_weights_from_distributed call and its broadcasts; with die_after, the
    process exits (as a crashed trainer) after broadcasting that many tensors."""
    reply = pool.submit(post, url, "/update_weights_from_distributed", announce(tensors, **extra))
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
