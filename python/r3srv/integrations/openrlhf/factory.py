"""`create_vllm_engines` with OpenRLHF 0.11.2's signature (openrlhf/trainer/ray/vllm_engine.py),
returning Ray actors of r3srv engines (rollout.RolloutEngine) placed as OpenRLHF places its own.

Placement: one engine per bundle, as OpenRLHF's: in the shared placement group it passes for
a hybrid engine (`shared_pg`, a fraction of a GPU per engine), else a PACK group of one bundle
per engine. An r3srv engine's tensor-parallel ranks are its own worker processes started by the
actor, so a bundle holds `tensor_parallel_size` GPUs (OpenRLHF's: one per vLLM Ray worker);
a hybrid engine (its bundles hold one GPU each) is then tensor parallel size 1. A cluster
without GPUs gets CPU bundles and CPU engines.
"""

from __future__ import annotations

import functools
from typing import Any

from r3srv.errors import ConfigError
from r3srv.integrations.openrlhf.rollout import RolloutEngine

HYBRID_GPU_SHARE = 0.2  # OpenRLHF's: engine and training actor share a GPU


@functools.cache
def rollout_ray_actor():
    """RolloutEngine as a Ray actor class (Ray is imported on first use: r3srv does not need it)."""
    import ray

    return ray.remote(RolloutEngine)


def create_vllm_engines(
    num_engines: int,
    tensor_parallel_size: int,
    pretrain: str,
    seed: int,
    full_determinism: bool,
    enable_prefix_caching: bool,
    enforce_eager: bool,
    max_model_len: int,
    shared_pg=None,
    gpu_memory_utilization=None,
    vllm_enable_sleep=False,
    logprobs_mode=None,
    agent_func_path: str | None = None,
    remote_rm_url: str | None = None,
    max_images_per_prompt: int = 0,
    *,
    engine_kwargs: dict[str, Any] | None = None,
) -> list:
    """OpenRLHF's factory on r3srv: `num_engines` actors with its RolloutRayActor's methods.
    `engine_kwargs` (r3srv's, after OpenRLHF's parameters): any r3srv engine option, e.g.
    `{"num_kv_blocks": 4096}`; it overrides what OpenRLHF's arguments set."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if max_images_per_prompt > 0:
        raise ConfigError("max_images_per_prompt > 0: multimodal rollouts are not wired through r3srv's "
                          "OpenRLHF engines (text prompts only)")
    gpu = ray.cluster_resources().get("GPU", 0) > 0
    hybrid = shared_pg is not None
    if hybrid and tensor_parallel_size > 1:
        raise ConfigError("a hybrid engine (colocate_all) with tensor_parallel_size > 1: r3srv's ranks run under "
                          "one actor, which a bundle of one GPU cannot hold; use tensor_parallel_size 1")
    if not hybrid:
        bundle = {"GPU": tensor_parallel_size, "CPU": 1} if gpu else {"CPU": 1}
        shared_pg = placement_group([dict(bundle) for _ in range(num_engines)], strategy="PACK")
        ray.get(shared_pg.ready())
    num_gpus = (HYBRID_GPU_SHARE if hybrid else tensor_parallel_size) if gpu else 0
    engines = []
    for i in range(num_engines):
        kwargs = dict(
            model=pretrain, enforce_eager=enforce_eager, tensor_parallel_size=tensor_parallel_size, seed=seed + i,
            max_model_len=max_model_len, enable_prefix_caching=enable_prefix_caching, dtype="bfloat16",
            device="cuda" if gpu else "cpu", full_determinism=full_determinism,
            gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=vllm_enable_sleep,
            agent_func_path=agent_func_path, remote_rm_url=remote_rm_url,
        )
        if logprobs_mode:
            kwargs.update(logprobs_mode=logprobs_mode, max_logprobs=1)
        kwargs.update(engine_kwargs or {})
        strategy = PlacementGroupSchedulingStrategy(placement_group=shared_pg, placement_group_capture_child_tasks=True,
                                                    placement_group_bundle_index=i)
        engines.append(rollout_ray_actor().options(num_cpus=0 if hybrid else 1, num_gpus=num_gpus,
                                                   scheduling_strategy=strategy).remote(**kwargs))
    if vllm_enable_sleep:
        ray.get([engine.sleep.remote() for engine in engines])
    return engines
