"""The worker side of r3srv's verl backend: what verl's training workers call on their rollout
(`get_rollout_class("r3srv", "async")`) to hand the accelerator back and forth and to push the
new policy after a training step (verl's rollout_mode: resume weights, update_weights, resume
kv_cache; trainer_mode: release).

The new weights go to the replica's server actor in buckets of
`checkpoint_engine.update_weights_bucket_megabytes`, each staged until every parameter arrived,
then applied between steps, so a partial push never serves a mix. Every training rank runs the
generator (FSDP gathers inside it); the replica's first rank sends. A one-rank replica takes the
bucket's tensors as they are (collective_rpc `update_weights_from_tensors`); a tensor-parallel
one has ranks in other processes, so the sending worker joins them in a weight-update group as
its rank 0 (`init_weights_update_group`, once) and broadcasts each bucket while the replica
receives it (`update_weights_from_distributed`), as SGLang-style trainers push.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
from collections.abc import Iterable
from typing import Any

import ray
import torch
import torch.distributed as dist
from verl.workers.rollout.base import BaseRollout

from r3srv import settings
from r3srv.engine.process_groups import group_on_store

logger = logging.getLogger(__name__)

MEGABYTE = 1 << 20
GROUP_NAME = "verl_weight_update"
JOIN_TIMEOUT = 600.0  # seconds: the replica joins between its engine's steps


class ServerAdapter(BaseRollout):
    def __init__(self, config, model_config, device_mesh, replica_rank: int = -1) -> None:
        super().__init__(config, model_config, device_mesh)
        rank = settings.launcher_rank()
        c = self.config
        rollout_world_size = c.tensor_model_parallel_size * c.data_parallel_size * c.pipeline_model_parallel_size
        self.replica_rank = rank // rollout_world_size if replica_rank == -1 else replica_rank
        self.rollout_rank = rank % rollout_world_size
        self.server_handle = None
        self.weight_group: dist.ProcessGroup | None = None  # tensor parallelism: this worker and the ranks

    def _server(self):
        """The replica's server actor, for its first rank (the others send nothing)."""
        if self.rollout_rank != 0:
            return None
        if self.server_handle is None:
            self.server_handle = ray.get_actor(f"{self.config.get('name', 'r3srv')}_server_{self.replica_rank}_0")
        return self.server_handle

    async def resume(self, tags: list[str]) -> None:
        server = self._server()
        if self.config.free_cache_engine and server is not None:
            await server.wake_up.remote(tags=tags)

    async def release(self) -> None:
        server = self._server()
        if self.config.free_cache_engine and server is not None:
            await server.sleep.remote()

    @torch.no_grad()
    async def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], global_steps: int | None = None,
                             wire_format: str = "named_tensors", **kwargs: Any) -> None:
        if wire_format != "named_tensors":
            raise NotImplementedError(f"r3srv's verl rollout takes wire_format='named_tensors', not {wire_format!r}")
        server = self._server()
        limit = self.config.checkpoint_engine.update_weights_bucket_megabytes * MEGABYTE
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        for name, tensor in weights:  # every rank iterates: the generator may gather across ranks
            if server is None:
                continue
            host = tensor.detach().to("cpu", copy=True).contiguous()
            bucket.append((name, host))
            size += host.numel() * host.element_size()
            if size >= limit:
                await self._send(server, bucket)
                bucket, size = [], 0
        if server is None:
            return
        if bucket:
            await self._send(server, bucket)
        await server.clear_kv_cache.remote()
        if global_steps is not None:
            await server.set_global_steps.remote(global_steps)

    async def _send(self, server, bucket: list[tuple[str, torch.Tensor]]) -> None:
        if self.config.tensor_model_parallel_size == 1:
            await server.collective_rpc.remote("update_weights_from_tensors", args=(bucket,))
            return
        group = await self._weight_group(server)
        announced = server.collective_rpc.remote("update_weights_from_distributed", kwargs=dict(
            names=[n for n, _ in bucket], dtypes=[str(t.dtype) for _, t in bucket],
            shapes=[list(t.shape) for _, t in bucket], group_name=GROUP_NAME))

        def broadcast() -> None:
            handles = [dist.broadcast(t, src=0, group=group, async_op=True) for _, t in bucket]
            for handle in handles:
                handle.wait()

        await asyncio.gather(asyncio.to_thread(broadcast), announced)

    async def _weight_group(self, server) -> dist.ProcessGroup:
        """A gloo group of this worker (rank 0, hosting the rendezvous) and the replica's
        tensor-parallel ranks (1..tp), made on the first push and kept."""
        if self.weight_group is None:
            if torch.cuda.is_available():  # NCCL refuses this worker and rank 0 sharing one GPU (hybrid)
                raise NotImplementedError("r3srv's verl rollout pushes weights to a tensor-parallel replica on the "
                                          "CPU only (gloo); on GPUs run rollout.tensor_model_parallel_size=1")
            address = ray.util.get_node_ip_address().strip("[]")
            world_size = self.config.tensor_model_parallel_size + 1
            # the rendezvous store listens (on a port it bound itself) before the replica learns its port
            store = dist.TCPStore(address, 0, world_size, is_master=True, wait_for_workers=False,
                                  timeout=datetime.timedelta(seconds=JOIN_TIMEOUT))
            joined = server.collective_rpc.remote("init_weights_update_group", kwargs=dict(
                master_address=address, master_port=store.port, rank_offset=1, world_size=world_size,
                group_name=GROUP_NAME, backend="gloo"))
            group, _ = await asyncio.gather(asyncio.to_thread(
                group_on_store, store, rank=0, world_size=world_size, group_name=GROUP_NAME, backend="gloo",
                timeout=JOIN_TIMEOUT), joined)
            self.weight_group = group
        return self.weight_group

    def generate_sequences(self, prompts):
        raise NotImplementedError("r3srv's verl rollout generates through its server (the agent loop)")
