"""r3srv as a verl rollout backend: `pip install r3srv`, then `actor_rollout_ref.rollout.name=r3srv`.

verl imports this module through its `verl.plugins` entry point (pyproject.toml) when verl
itself is imported (or through VERL_USE_EXTERNAL_MODULES=r3srv.integrations.verl). It registers:

- the replica (`replica.R3srvReplica`) under RolloutReplicaRegistry's name "r3srv": verl's
  LLMServerManager launches it like vLLM's, one server actor per replica
  (`server.R3srvRolloutServer`: r3srv's engine through r3srv.compat.vllm, its HTTP routes, and
  the methods verl's agent loop and trainer call);
- the worker-side rollout (`adapter.ServerAdapter`) under ("r3srv", "async") in verl's rollout
  registry: what verl's training workers call to release and resume memory and push weights.

docs/rl.md ("verl") gives the recipe.
"""

from __future__ import annotations

NAME = "r3srv"


def _load_replica():
    from r3srv.integrations.verl.replica import R3srvReplica

    return R3srvReplica


def register() -> None:
    """Make `rollout.name=r3srv` resolvable (idempotent)."""
    from verl.workers.rollout import base
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    RolloutReplicaRegistry.register(NAME, _load_replica)
    base._ROLLOUT_REGISTRY[(NAME, "async")] = "r3srv.integrations.verl.adapter.ServerAdapter"


register()
