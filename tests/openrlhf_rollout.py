"""OpenRLHF 0.11.2's rollout on r3srv's engine factory, on a one-node CPU Ray cluster: run in
OpenRLHF's own environment (tools/openrlhf_env.sh) by tests/test_openrlhf_rollout.py.

    .openrlhf_venv/bin/python tests/openrlhf_rollout.py V0_CHECKPOINT V1_CHECKPOINT OUT.npz

What runs, in OpenRLHF's order:
1. `r3srv.integrations.openrlhf.create_vllm_engines` with the arguments OpenRLHF's CLI passes
   (cli/train_ppo_ray.py, train(): sleep on, processed logprobs as with rollout correction);
2. the samples generator's round (trainer/ppo_utils/samples_generator.py): `wake_up`,
   `get_num_unfinished_requests`, `generate_responses` with the SamplingParams fields
   `_dispatch_prompts_to_vllm` sets, run by OpenRLHF's own SingleTurnAgentExecutor
   (openrlhf/utils/agent.py) inside the engine actor, calling back the actor's `generate`; then
   `sleep`;
3. the trainer's weight sync (trainer/ray/ppo_actor.py `_init_vllm_sync_group` and
   `broadcast_to_vllm`'s `_broadcast_param`) with `--vllm.sync_with_ray --vllm.sync_backend gloo`,
   its only CPU road, from a Ray actor holding the second checkpoint's tensors. Those two methods
   are restated here, line for line in their calls: their module imports deepspeed, and
   `broadcast_to_vllm` ends in `torch.cuda.synchronize()`, which a CPU build of torch refuses;
4. a second round, on the new weights;
5. the async trainer's partial-rollout sync (trainer/ppo_trainer_async.py `broadcast_to_vllm`):
   `pause_generation` (vLLM's keep), a round submitted meanwhile (it waits), the first
   checkpoint broadcast back, `resume_generation`: that round runs on the first weights again.
Only `vllm` is absent here: SamplingParams is r3srv.compat.vllm's (OpenRLHF's modules that build
it import vLLM at module level, so the generator's call is restated with its fields).
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import numpy as np

PROMPTS = ["The quick brown fox", "Routed experts, every layer:", "abc abc abc"]
N_SAMPLES = 2  # --rollout.n_samples_per_prompt
MAX_NEW_TOKENS = 6
MAX_LEN = 48  # --data.max_len
# r3srv's, through --r3srv.engine_kwargs: float32 (OpenRLHF asks bfloat16), where a batch of six
# and a request alone sample the same greedy tokens, so r3srv's own LLM is an exact oracle
ENGINE_KWARGS = {"num_kv_blocks": 32, "block_size": 16, "dtype": "float32"}
GROUP = "openrlhf"  # ppo_actor.py's group_name


def sampling_params():
    """samples_generator.py's _dispatch_prompts_to_vllm, greedy (--rollout.temperature 0), with
    rollout correction on (logprobs=1)."""
    import r3srv.compat.vllm as vllm

    return vllm.SamplingParams(temperature=0.0, top_p=1.0, top_k=-1, max_tokens=MAX_NEW_TOKENS, min_tokens=1,
                               skip_special_tokens=False, logprobs=1)


def submit(engine, tokenizer) -> list:
    """The samples generator's _dispatch_prompts_to_vllm: one generate_responses per prompt."""
    return [engine.generate_responses.remote(prompt=p, label="", sampling_params=sampling_params(),
                                             max_length=MAX_LEN, hf_tokenizer=tokenizer, num_samples=N_SAMPLES)
            for p in PROMPTS]


def actions(refs) -> list[list[int]]:
    import ray

    return [r["observation_tokens"][r["action_ranges"][0][0]:] for batch in ray.get(refs) for r in batch]


def rollout(engine, tokenizer) -> dict:
    """One round of the samples generator on one engine: OpenRLHF's executor's responses, and
    the rows of each (the actor's `generate`, which the executor called, asked again)."""
    import ray

    ray.get(engine.wake_up.remote())
    assert ray.get(engine.get_num_unfinished_requests.remote()) == 0
    params = sampling_params()
    responses = [r for batch in ray.get(submit(engine, tokenizer)) for r in batch]
    prompts, actions, logprobs, rows = [], [], [], []
    for r in responses:
        (start, end), = r["action_ranges"]
        prompt, action = r["observation_tokens"][:start], r["observation_tokens"][start:end]
        out = ray.get(engine.generate.remote(prompt, params)).outputs[0]
        assert list(out.token_ids) == action, "the executor's action is what the actor's generate samples"
        prompts.append(prompt)
        actions.append(action)
        logprobs.append(r["rollout_log_probs"][start:end])
        rows.append(out.routed_experts)
    ray.get(engine.sleep.remote())
    slept = ray.get(engine.is_sleeping.remote())
    return {"prompt_ids": prompts, "response_ids": actions, "logprobs": logprobs, "rows": rows, "slept": slept}


def trainer_class():
    import ray
    import torch

    @ray.remote
    class Trainer:
        """OpenRLHF's policy actor's weight sync, with the second checkpoint's tensors as its policy."""

        def __init__(self, checkpoint: str) -> None:
            self.load(checkpoint)

        def load(self, checkpoint: str) -> None:
            """The policy's parameters: a checkpoint's tensors."""
            from safetensors.torch import load_file

            files = sorted(Path(checkpoint).glob("*.safetensors"))
            self.params = {k: v.to(getattr(torch, ENGINE_KWARGS["dtype"])) for f in files
                           for k, v in load_file(f).items()}

        def init_vllm_sync_group(self, engines, tensor_parallel_size: int = 1) -> None:
            """ppo_actor.py _init_vllm_sync_group with use_ray=True, backend gloo."""
            from ray.util import collective

            master_address = ray._private.services.get_node_ip_address()
            with socket.socket() as sock:
                sock.bind(("", 0))
                master_port = sock.getsockname()[1]
            world_size = len(engines) * tensor_parallel_size + 1
            refs = [engine.init_process_group.remote(master_address, master_port, i * tensor_parallel_size + 1,
                                                     world_size, GROUP, backend="gloo", use_ray=True)
                    for i, engine in enumerate(engines)]
            collective.init_collective_group(world_size=world_size, rank=0, backend="gloo", group_name=GROUP)
            ray.get(refs)

        def broadcast_to_vllm(self, engines) -> int:
            """ppo_actor.py broadcast_to_vllm (prefix caching on): reset, then per parameter
            update_weight on every engine beside the broadcast."""
            from ray.util import collective

            cache_reset_refs = [engine.reset_prefix_cache.remote() for engine in engines]
            num_params = len(self.params)
            for count, (name, param) in enumerate(self.params.items(), start=1):
                refs = [engine.update_weight.remote(name, dtype=param.dtype, shape=param.shape,
                                                    empty_cache=count == num_params) for engine in engines]
                collective.broadcast(param.data, 0, group_name=GROUP)
                ray.get(refs)
            ray.get(cache_reset_refs)
            return num_params

    return Trainer


def main(v0: str, v1: str, out: str) -> None:
    import ray
    from transformers import PreTrainedTokenizerFast

    from r3srv.integrations.openrlhf import create_vllm_engines

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=True)
    try:
        # cli/train_ppo_ray.py train(): num_engines, tp, pretrain, seed, full_determinism,
        # enable_prefix_caching, enforce_eager, max_len, pg, gpu_memory_utilization,
        # enable_sleep, logprobs_mode, agent_func_path, remote_rm_url, max_images_per_prompt
        engines = create_vllm_engines(1, 1, v0, 42, False, True, False, MAX_LEN, None, 0.5, True,
                                      "processed_logprobs", agent_func_path=None, remote_rm_url=None,
                                      max_images_per_prompt=0, engine_kwargs=ENGINE_KWARGS)
        engine = engines[0]
        asleep_after_factory = ray.get(engine.is_sleeping.remote())
        tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(Path(v0) / "tokenizer.json"))
        first = rollout(engine, tokenizer)
        trainer = trainer_class().remote(v1)
        ray.get(trainer.init_vllm_sync_group.remote(engines))
        ray.get(engine.wake_up.remote(["weights"]))  # colocated loops wake the weights for the sync
        sent = ray.get(trainer.broadcast_to_vllm.remote(engines))
        second = rollout(engine, tokenizer)
        ray.get(engine.wake_up.remote())
        ray.get(engine.pause_generation.remote())  # ppo_trainer_async.py broadcast_to_vllm, partial rollout
        waiting = submit(engine, tokenizer)
        ray.get(trainer.load.remote(v0))
        ray.get(trainer.broadcast_to_vllm.remote(engines))
        ray.get(engine.resume_generation.remote())
        resumed = actions(waiting)
        ipc_refusal = ""
        try:
            ray.get(engine.update_weight_cuda_ipc.remote("lm_head.weight", "bfloat16", [1], {}))
        except Exception as exc:  # a RayTaskError wrapping r3srv's InvalidRequestError
            ipc_refusal = str(exc).strip().splitlines()[-1]
    finally:
        ray.shutdown()
    data = {"asleep_after_factory": asleep_after_factory, "params_sent": sent, "ipc_refusal": ipc_refusal,
            "resumed_response_ids": np.array([np.asarray(a) for a in resumed] + [None], dtype=object)[:-1]}
    for name, got in (("first", first), ("second", second)):
        data[f"{name}_slept"] = got["slept"]
        for key in ("prompt_ids", "response_ids", "logprobs", "rows"):
            data[f"{name}_{key}"] = np.array([np.asarray(x) for x in got[key]] + [None], dtype=object)[:-1]
    np.savez(out, **data)


if __name__ == "__main__":
    main(*sys.argv[1:4])
