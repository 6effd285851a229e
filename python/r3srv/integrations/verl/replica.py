"""r3srv's verl rollout replica: one server actor (server.R3srvRolloutServer) per replica.

verl's LLMServerManager makes `world_size // (tp * dp * pp)` replicas and starts each hybrid (on
the training workers' GPUs, given their worker group), colocated or standalone. The server
actor lands on the node of the replica's first worker with those workers' GPUs visible; its
engine runs `rollout.tensor_model_parallel_size` ranks (r3srv's worker processes, with
`enable_expert_parallel` when `rollout.expert_parallel_size > 1`). On a cluster without GPUs a
standalone replica runs on the CPU, started without a GPU resource pool.
"""

from __future__ import annotations

import ray
from verl.workers.rollout.replica import RolloutMode, RolloutReplica

from r3srv.integrations.verl.server import R3srvRolloutServer

SERVER_NAME_PREFIX = "r3srv_"  # ServerAdapter finds the server as f"{rollout.name}_server_{replica}_{node}"


class R3srvReplica(RolloutReplica):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        c = self.config
        if c.data_parallel_size != 1 or c.pipeline_model_parallel_size != 1:
            raise ValueError(
                f"rollout.data_parallel_size={c.data_parallel_size}, pipeline_model_parallel_size="
                f"{c.pipeline_model_parallel_size}: r3srv's verl replica runs tensor (and expert) parallelism "
                "only; verl's data parallelism is its number of replicas (n_gpus_per_node * nnodes / tp)")
        if self.nnodes != 1:
            raise ValueError(f"a replica of {self.world_size} ranks spans {self.nnodes} nodes: r3srv's verl "
                             "replica runs on one node")
        self.server_class = ray.remote(R3srvRolloutServer)

    async def init_standalone(self) -> None:
        if ray.cluster_resources().get("GPU", 0) > 0:
            await super().init_standalone()
            return
        self.rollout_mode = RolloutMode.STANDALONE  # a CPU cluster: no GPU pool to reserve
        self.workers = []
        await self.launch_servers()

    def rollout_worker_use_gpu(self) -> bool:
        return ray.cluster_resources().get("GPU", 0) > 0

    async def launch_servers(self) -> None:
        node_id, devices = await self._placement()
        name = f"{SERVER_NAME_PREFIX}server_{self.replica_rank}_0{self.name_suffix}"
        if self.is_reward_model:
            name = f"{SERVER_NAME_PREFIX}server_reward_{self.replica_rank}_0{self.name_suffix}"
        elif self.is_teacher_model:
            name = f"{SERVER_NAME_PREFIX}server_teacher_{self.replica_rank}_0{self.name_suffix}"
        server = self.server_class.options(
            scheduling_strategy=ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(node_id=node_id,
                                                                                               soft=False),
            name=name,
            max_concurrency=self.max_concurrency,
        ).remote(config=self.config, model_config=self.model_config, rollout_mode=self.rollout_mode,
                 workers=self.workers, replica_rank=self.replica_rank, node_rank=0,
                 gpus_per_node=self.gpus_per_replica_node, nnodes=1, cuda_visible_devices=devices)
        await server.launch_server.remote()
        self.servers = [server]
        self._server_handle = server
        address, port = await server.get_server_address.remote()
        self._server_address = f"{address}:{port}"

    async def _placement(self) -> tuple[str, str]:
        """(node id, CUDA_VISIBLE_DEVICES) of the replica's workers; this node and none without."""
        if not self.workers:
            return ray.get_runtime_context().get_node_id(), ""

        def where(worker_self):
            context = ray.get_runtime_context()
            return context.get_node_id(), [str(g) for g in context.get_accelerator_ids().get("GPU", [])]

        infos = [await worker.__ray_call__.remote(where) for worker in self.workers]
        return infos[0][0], ",".join(g for _, gpus in infos for g in gpus)

    async def sleep(self) -> None:
        await self.servers[0].wait_for_requests_to_drain.remote()
        await self.servers[0].sleep.remote()

    async def abort_all_requests(self, reject_request: bool = False) -> dict:
        return await self.servers[0].abort_all_requests.remote(reject_request=reject_request)

    async def abort_request(self, request_id: str) -> dict:
        return await self.servers[0].abort_request.remote(request_id)
