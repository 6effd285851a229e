"""The worker side of r3srv's verl backend: what verl's training workers call on their rollout
(`get_rollout_class("r3srv", "async")`) to hand the accelerator back and forth and to push the
new policy after a training step (verl's rollout_mode: resume weights, update_weights, resume
kv_cache; trainer_mode: release).

The new weights go to the replica's server actor in buckets of
`checkpoint_engine.update_weights_bucket_megabytes`, each through r3srv's collective_rpc table
(`update_weights_from_tensors`): staged until every parameter arrived, then applied between
steps, so a partial push never serves a mix. Every training rank runs the generator (FSDP
gathers inside it); the replica's first rank sends.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import ray
import torch
from verl.workers.rollout.base import BaseRollout

from r3srv import settings

logger = logging.getLogger(__name__)

MEGABYTE = 1 << 20


class ServerAdapter(BaseRollout):
    def __init__(self, config, model_config, device_mesh, replica_rank: int = -1) -> None:
        super().__init__(config, model_config, device_mesh)
        rank = settings.launcher_rank()
        c = self.config
        rollout_world_size = c.tensor_model_parallel_size * c.data_parallel_size * c.pipeline_model_parallel_size
        self.replica_rank = rank // rollout_world_size if replica_rank == -1 else replica_rank
        self.rollout_rank = rank % rollout_world_size
        self.server_handle = None

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
                await server.collective_rpc.remote("update_weights_from_tensors", args=(bucket,))
                bucket, size = [], 0
        if server is None:
            return
        if bucket:
            await server.collective_rpc.remote("update_weights_from_tensors", args=(bucket,))
        await server.clear_kv_cache.remote()
        if global_steps is not None:
            await server.set_global_steps.remote(global_steps)

    def generate_sequences(self, prompts):
        raise NotImplementedError("r3srv's verl rollout generates through its server (the agent loop)")
