"""verl's own async rollout on r3srv, run by verl's Python (its own environment, tools/verl_env.sh):
a one-node CPU Ray cluster, `actor_rollout_ref.rollout.name=r3srv` resolved through the
`verl.plugins` entry point, verl's LLMServerManager and AgentLoopManager running verl's example
agent loop (single_turn_agent) with routing replay on, then verl's worker-side path between two
rollouts: trainer_mode (release) and rollout_mode (resume weights, push the new policy through
update_weights, resume kv_cache), as verl's training workers call their rollout; then a third,
training rollout (not validation: verl's temperature, top-k and top-p) with verl's default
rollout.logprobs_mode=processed_logprobs.

    python tests/verl_agent_loop.py CKPT_V0 CKPT_V1 OUT.npz [TP [REPLICAS]]

TP is rollout.tensor_model_parallel_size (and expert_parallel_size: experts split over the TP
ranks); verl makes one replica per TP trainer workers, so the
stand-in worker group holds TP * REPLICAS workers. Every rollout starts with the replicas paused
until verl's load balancer has routed each request, so how the requests spread follows from
its rule (fewest in flight), not from how fast a replica answers.

OUT.npz holds what verl's batch carried (prompt and response ids, rows, logprobs) for the test
(tests/test_verl_rollout.py) to hold against r3srv's own API, the sleep states seen and the
requests routed to each replica.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

NUM_PROMPTS = 3
PROMPT_LENGTH = 48  # the chat-templated prompts are 44 tokens
RESPONSE_LENGTH = 8
# the training rollout's sampling (rollout.temperature, top_k, top_p): the processed logprobs differ from the raw
TEMPERATURE, TOP_K, TOP_P = 1.5, 6, 0.9


def config_for(model_path: str, tp: int = 1, replicas: int = 1):
    import verl
    from hydra import compose, initialize_config_dir

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    overrides = [
        f"actor_rollout_ref.model.path={model_path}",
        "actor_rollout_ref.rollout.name=r3srv",
        f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp}",
        # experts split over the replica's ranks where it has several (verl: expert_parallel_size
        # = tp x data_parallel_size, workers/config/rollout.py), r3srv's --enable-expert-parallel
        f"actor_rollout_ref.rollout.expert_parallel_size={tp}",
        f"actor_rollout_ref.rollout.prompt_length={PROMPT_LENGTH}",
        f"actor_rollout_ref.rollout.response_length={RESPONSE_LENGTH}",
        f"actor_rollout_ref.rollout.max_model_len={PROMPT_LENGTH + RESPONSE_LENGTH}",
        "actor_rollout_ref.rollout.max_num_batched_tokens=256",
        "actor_rollout_ref.rollout.dtype=float32",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        "actor_rollout_ref.rollout.enable_rollout_routing_replay=True",
        "actor_rollout_ref.rollout.calculate_log_probs=True",
        f"actor_rollout_ref.rollout.temperature={TEMPERATURE}",
        f"actor_rollout_ref.rollout.top_k={TOP_K}",
        f"actor_rollout_ref.rollout.top_p={TOP_P}",
        "actor_rollout_ref.rollout.val_kwargs.temperature=0",
        "actor_rollout_ref.rollout.val_kwargs.top_k=-1",
        "actor_rollout_ref.rollout.val_kwargs.top_p=1.0",
        # the replica's ranks on one node: verl/workers/rollout/replica.py (RolloutReplica.__init__,
        # gpus_per_replica_node = min(n_gpus_per_node, tp), nnodes = tp // that)
        f"actor_rollout_ref.rollout.n_gpus_per_node={tp * replicas}",
        "+actor_rollout_ref.rollout.engine_kwargs.r3srv.num_kv_blocks=64",
        "+actor_rollout_ref.rollout.engine_kwargs.r3srv.block_size=16",
    ]
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(config_name="ppo_trainer", overrides=overrides)


def trainer_stand_in():
    """A training worker of verl's worker group, reduced to its rollout calls (verl's
    fsdp_workers rollout_mode / trainer_mode around its own training step)."""
    from verl.single_controller.base import Worker
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.rollout.base import get_rollout_class

    class TrainerStandIn(Worker):
        def __init__(self, config):
            super().__init__()
            self.config = config
            self.rollout = None

        def _rollout(self):
            if self.rollout is None:
                model_config = omega_conf_to_dataclass(self.config.actor_rollout_ref.model)
                rollout_cls = get_rollout_class(self.config.actor_rollout_ref.rollout.name, "async")
                self.rollout = rollout_cls(self.config.actor_rollout_ref.rollout, model_config, None)
            return self.rollout

        def rollout_class(self) -> str:
            cls = type(self._rollout())
            return f"{cls.__module__}.{cls.__qualname__}"

        async def trainer_mode(self):
            await self._rollout().release()

        async def rollout_mode(self, checkpoint: str, global_steps: int):
            from safetensors.torch import load_file

            tensors = {}
            for shard in sorted(os.listdir(checkpoint)):
                if shard.endswith(".safetensors"):
                    tensors |= load_file(os.path.join(checkpoint, shard))
            rollout = self._rollout()
            await rollout.resume(tags=["weights"])
            await rollout.update_weights(iter(tensors.items()), global_steps=global_steps)
            await rollout.resume(tags=["kv_cache"])

    return TrainerStandIn


def prompts_batch(validate: bool = True):
    from verl import DataProto

    raw = np.empty(NUM_PROMPTS, dtype=object)
    for i in range(NUM_PROMPTS):
        raw[i] = [{"role": "user", "content": f"rollout {i}: name {i + 2} experts"}]
    batch = DataProto.from_single_dict({"raw_prompt": raw, "agent_name": np.array(["single_turn_agent"] * NUM_PROMPTS,
                                                                                 dtype=object)})
    batch.meta_info["validate"] = validate  # val_kwargs: greedy, so r3srv's own API can replay it
    return batch


def unpadded(batch) -> dict[str, list]:
    prompts, responses = batch.batch["prompts"], batch.batch["responses"]
    mask = batch.batch["attention_mask"]
    plen = prompts.shape[1]
    out = {"prompt_ids": [], "response_ids": [], "rows": [], "logprobs": []}
    for i in range(len(batch)):
        p_mask, r_mask = mask[i, :plen].bool(), mask[i, plen:].bool()
        prompt = prompts[i][p_mask].tolist()
        response = responses[i][r_mask].tolist()
        start = plen - len(prompt)
        rows = batch.batch["routed_experts"][i, start:start + len(prompt) + len(response) - 1].numpy()
        out["prompt_ids"].append(prompt)
        out["response_ids"].append(response)
        out["rows"].append(rows)
        out["logprobs"].append(batch.batch["rollout_log_probs"][i, :len(response)].tolist())
    return out


def routed_rollout(loops, balancer, replica_servers: list, batch) -> tuple:
    """verl's agent loop over `batch` with every replica paused (r3srv's abort_all_requests with
    nothing in flight: arrivals wait) until verl's load balancer holds all requests in flight;
    then (the batch, requests routed per replica address). The balancer picks the replica with
    fewest in flight (verl/workers/rollout/router.py, GlobalRequestLoadBalancer.acquire_server)."""
    import ray

    ray.get([s.abort_all_requests.remote(reset_prefix_cache=False) for s in replica_servers])
    with ThreadPoolExecutor(max_workers=1) as pool:
        running = pool.submit(loops.generate_sequences, batch)
        deadline = time.monotonic() + 600
        while (status := ray.get(balancer.get_status.remote()))["total_inflight"] < len(batch):
            if running.done():
                running.result()  # raises what failed
                raise RuntimeError(f"the rollout finished with replicas paused: {status}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"verl routed fewer than {len(batch)} requests in 600 s: {status}")
            time.sleep(0.05)  # polls verl's balancer; nothing generates meanwhile
        ray.get([s.resume_generation.remote() for s in replica_servers])
        return running.result(), dict(status["servers"])


def main(v0: str, v1: str, out_path: str, tp: int = 1, replicas: int = 1) -> None:
    import httpx
    import ray
    import verl  # noqa: F401  (loads the verl.plugins entry points: r3srv registers itself)
    from verl.experimental.agent_loop.agent_loop import AgentLoopManager
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl.workers.rollout.llm_server import LLMServerManager
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    started = time.monotonic()
    replica_cls = RolloutReplicaRegistry.get("r3srv")
    ray.init(num_cpus=8, include_dashboard=False, runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
    try:
        config = config_for(v0, tp, replicas)
        # verl's hybrid replica count is the worker group's world size // tp
        # (verl/workers/rollout/llm_server.py, LLMServerManager._initialize_llm_servers)
        pool = RayResourcePool(process_on_nodes=[tp * replicas], use_gpu=False, max_colocate_count=1)
        workers = RayWorkerGroup(resource_pool=pool, device_name="cpu",
                                 ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(trainer_stand_in()),
                                                                        config=config))
        trainers = workers.workers
        servers = LLMServerManager.create(config, worker_group=workers)
        loops = AgentLoopManager.create(config, llm_client=servers.get_client())
        assert len(servers.get_replicas()) == replicas, [r.replica_rank for r in servers.get_replicas()]
        replica_servers = [replica.servers[0] for replica in servers.get_replicas()]
        # each replica's own /server_info: did verl's expert_parallel_size reach r3srv's engine?
        ep_sizes = [httpx.get("http://%s:%d/server_info" % tuple(ray.get(s.get_server_address.remote())),
                              timeout=60).json()["ep_size"] for s in replica_servers]
        addresses = servers.get_addresses()
        balancer = servers.global_load_balancer

        def rollout(validate: bool = True):
            batch, routed = routed_rollout(loops, balancer, replica_servers, prompts_batch(validate))
            return batch, [routed.get(a, 0) for a in addresses]

        first_batch, first_routed = rollout()
        first = unpadded(first_batch)
        ray.get([t.trainer_mode.remote() for t in trainers])  # every training rank calls its rollout
        slept = ray.get([s.is_sleeping.remote() for s in replica_servers])
        ray.get([t.rollout_mode.remote(v1, 1) for t in trainers])
        awake = [not asleep for asleep in ray.get([s.is_sleeping.remote() for s in replica_servers])]
        second_batch, second_routed = rollout()
        second = unpadded(second_batch)
        steps = [int(s) for s in second_batch.non_tensor_batch.get("max_global_steps", [-1])]
        third = unpadded(rollout(validate=False)[0])
        np.savez(
            out_path,
            replica_class=f"{replica_cls.__module__}.{replica_cls.__qualname__}",
            rollout_class=ray.get(trainers[0].rollout_class.remote()),
            slept=np.array(slept), awake=np.array(awake), global_steps=np.array(steps),
            first_routed=np.array(first_routed), second_routed=np.array(second_routed), ep_sizes=np.array(ep_sizes),
            seconds=time.monotonic() - started,
            **{f"first_{k}": np.array(v, dtype=object) for k, v in first.items()},
            **{f"second_{k}": np.array(v, dtype=object) for k, v in second.items()},
            **{f"third_{k}": np.array(v, dtype=object) for k, v in third.items()},
        )
    finally:
        ray.shutdown()


if __name__ == "__main__":
    asyncio.set_event_loop_policy(None)
    main(*sys.argv[1:4], *map(int, sys.argv[4:6]))
