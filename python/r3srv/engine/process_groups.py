"""Process groups with a trainer, outside the server's default group (which the trainer may not
have): made on a TCPStore that rank 0 hosts, as SGLang's model runner and vLLM's workers do."""

from __future__ import annotations

import datetime

import torch.distributed as dist


def group_on_store(store: dist.Store, *, rank: int, world_size: int, group_name: str, backend: str,
                   timeout: float) -> dist.ProcessGroup:
    """A `backend` group of `world_size` ranks whose rendezvous keys live in `store` under `group_name`
    (every member names the group alike)."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world

    group, _ = _new_process_group_helper(
        world_size, rank, [], Backend(backend), PrefixStore(group_name, store), group_name=group_name,
        backend_options=None, timeout=datetime.timedelta(seconds=timeout),
    )
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def init_custom_process_group(
    *, master_address: str, master_port: int, rank: int, world_size: int, group_name: str, backend: str,
    timeout: float,
) -> dist.ProcessGroup:
    """Join a process group outside the default one, as SGLang's model runner and the trainers
    written for it do: a TCPStore rendezvous at tcp://master_address:master_port (hosted by
    rank 0), keys under `group_name`. Works with or without a default process group."""
    from torch.distributed.distributed_c10d import rendezvous

    wait = datetime.timedelta(seconds=timeout)
    store, rank, world_size = next(rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size, timeout=wait))
    store.set_timeout(wait)
    return group_on_store(store, rank=rank, world_size=world_size, group_name=group_name, backend=backend,
                          timeout=timeout)


def broadcast_from_trainer(group, tensors, arrived=None) -> None:
    """Receive `tensors` in order, each a broadcast from rank 0 of `group`: a torch process group
    (all posted at once, so the transfers pipeline instead of paying a round trip each, as SGLang
    does) or a communicator with its own `broadcast` (engine/vllm_transfer.py's NCCL one)."""
    tensors = list(tensors)
    if isinstance(group, dist.ProcessGroup):
        handles = [dist.broadcast(tensor, src=0, group=group, async_op=True) for tensor in tensors]
        for done, handle in enumerate(handles, 1):
            handle.wait()
            if arrived is not None:
                arrived(done)
        return
    for done, tensor in enumerate(tensors, 1):
        group.broadcast(tensor)
        if arrived is not None:
            arrived(done)


def destroy_group(group) -> None:
    if isinstance(group, dist.ProcessGroup):
        dist.destroy_process_group(group)
    else:
        group.destroy()
