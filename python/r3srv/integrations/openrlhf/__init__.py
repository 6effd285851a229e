"""r3srv as OpenRLHF's rollout engines, through its engine factory (openrlhf 0.11.2).

OpenRLHF builds its vLLM engines with `openrlhf.trainer.ray.create_vllm_engines`: Ray actors
(its `RolloutRayActor`) that its samples generator, agent executors and trainer call by method
name. `factory.create_vllm_engines` has that function's signature and returns Ray actors with
those methods (`rollout.RolloutEngine`), each over one r3srv engine through
r3srv.compat.vllm, routed experts on. `python -m r3srv.integrations.openrlhf.train_ppo_ray ...`
runs OpenRLHF's own PPO entry point with the factory swapped in. docs/rl.md ("OpenRLHF") gives
the recipe.

Ray is imported when the factory runs or an engine joins a Ray collective group, never on import.
"""

from __future__ import annotations

from r3srv.integrations.openrlhf.factory import create_vllm_engines
from r3srv.integrations.openrlhf.rollout import RolloutEngine

__all__ = ["RolloutEngine", "create_vllm_engines"]
