"""One r3srv engine with the methods OpenRLHF calls on its rollout actor.

OpenRLHF 0.11.2's `RolloutRayActor` (openrlhf/trainer/ray/vllm_engine.py) is what its samples
generator (`generate_responses`, `get_num_unfinished_requests`), its agent executors
(`generate(prompt_token_ids, sampling_params, multi_modal_data)`, called back with the actor
as `llm_engine`), its trainer (`init_process_group`, `update_weight`, `update_weight_cuda_ipc`,
`reset_prefix_cache`) and its colocated loop (`sleep`, `wake_up`, `pause_generation`,
`resume_generation`) call. `RolloutEngine` answers the same calls, with the same arguments,
over r3srv.compat.vllm's AsyncLLM (r3srv's one engine), routed experts on: the final
RequestOutput of `generate` carries `outputs[0].routed_experts`, one row per token but the last.

Weights: `init_process_group(..., use_ray=False)` and `update_weight` go to r3srv's
collective_rpc table (a torch.distributed group, as OpenRLHF's vLLM worker extension joins);
with `use_ray=True` (OpenRLHF's `--vllm.sync_with_ray`, the one road its trainer offers a CPU
backend: `--vllm.sync_backend gloo`) the engine joins the trainer's ray.util.collective group,
receives each broadcast tensor and hands it to r3srv as `update_weights_from_tensors`: either
way tensors are staged until every parameter arrived, then applied between steps.
`update_weight_cuda_ipc` opens CUDA IPC handles: on a CPU engine it is refused by name.
"""

from __future__ import annotations

import asyncio
import importlib.util
import uuid
from copy import deepcopy
from typing import Any

import msgspec
import torch

import r3srv.compat.vllm as vllm
from r3srv.errors import ConfigError, InvalidRequestError
from r3srv.outputs import RequestOutput


class RolloutEngine:
    """OpenRLHF's RolloutRayActor contract on r3srv (`factory` wraps it in `ray.remote`).

    Keywords: the engine keywords OpenRLHF's factory passes to vLLM (r3srv.compat.vllm takes
    them: r3srv options, settings without effect here, or refusals naming them), plus its
    actor's own (`agent_func_path`, `remote_rm_url`, `mm_pad_token_ids`, `full_determinism`).
    OpenRLHF's `logprobs_mode="processed_logprobs"` (with rollout correction) is r3srv's engine
    option of that name: each sampled token's logprob under the distribution it was drawn from."""

    def __init__(self, model: str, *, agent_func_path: str | None = None, remote_rm_url: Any = None,
                 mm_pad_token_ids: Any = None, full_determinism: bool = False, **engine_kwargs: Any) -> None:
        if mm_pad_token_ids:
            raise ConfigError("multimodal rollouts (max_images_per_prompt > 0) are not wired through r3srv's "
                              "OpenRLHF engines: text prompts only")
        # full_determinism turns off vLLM's engine subprocess; r3srv's engine runs in this process.
        self.agent_func_path = agent_func_path
        self.remote_rm_url = remote_rm_url
        self._executor = None
        self._ray_group: tuple[str, str] | None = None  # (name, backend) of a ray.util.collective group joined
        self.llm = vllm.AsyncLLM(model, **{"enable_return_routed_experts": True, **engine_kwargs})
        self.tensor_parallel_size = int(engine_kwargs.get("tensor_parallel_size", 1) or 1)

    # -- generation (the agent executors' callback) ----------------------------------------
    async def generate(self, prompt_token_ids: list[int], sampling_params: Any,
                       multi_modal_data: Any = None) -> RequestOutput:
        """One request, token ids in; its final RequestOutput (vLLM's shape, routed experts on)."""
        if multi_modal_data:
            raise InvalidRequestError("multi_modal_data is not served by r3srv's OpenRLHF engines (text only)",
                                      param="multi_modal_data")
        params = openrlhf_params(sampling_params)
        params.output_kind = vllm.RequestOutputKind.FINAL_ONLY
        final = None
        async for out in self.llm.generate(vllm.TokensPrompt(prompt_token_ids=list(prompt_token_ids)), params,
                                           request_id=uuid.uuid4().hex):
            final = out
        return final

    def get_num_unfinished_requests(self) -> int:
        return self.llm.get_num_unfinished_requests()

    async def generate_responses(self, prompt: str, label: str, sampling_params: Any, max_length: int,
                                 hf_tokenizer: Any, num_samples: int = 1, images: Any = None) -> list[dict]:
        """N samples of one prompt through OpenRLHF's agent executor (its own code, from
        openrlhf.utils.agent or the --train.agent_func_path file), calling back `generate`."""
        executor = self.agent_executor()
        return await asyncio.gather(*[
            executor.execute(prompt=prompt, label=label, sampling_params=sampling_params, max_length=max_length,
                             hf_tokenizer=hf_tokenizer, llm_engine=self, images=images)
            for _ in range(num_samples)])

    def agent_executor(self):
        """OpenRLHF's executor, chosen as its actor chooses it (made on first use: the module
        needs OpenRLHF, which `generate` alone does not)."""
        if self._executor is None:
            from openrlhf.utils.agent import AgentExecutorBase, SingleTurnAgentExecutor

            if self.agent_func_path:
                self._executor = load_agent_executor(self.agent_func_path, AgentExecutorBase)
            else:
                self._executor = SingleTurnAgentExecutor(self.remote_rm_url)
        return self._executor

    # -- weights ---------------------------------------------------------------------------
    async def init_process_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                 group_name: str, backend: str, use_ray: bool) -> Any:
        if not use_ray:
            return await self.llm.collective_rpc(
                "init_process_group", args=(master_address, master_port, rank_offset, world_size, group_name, backend))
        if self.tensor_parallel_size != 1:
            raise InvalidRequestError("use_ray=True (a ray.util.collective group) needs tensor_parallel_size 1 on "
                                      "r3srv: its ranks hold the process's torch.distributed world; use "
                                      "use_ray=False", param="use_ray")
        from ray.util import collective

        await asyncio.to_thread(collective.init_collective_group, world_size=world_size, rank=rank_offset,
                                backend=backend, group_name=group_name)
        self._ray_group = (group_name, backend)
        return [None]

    async def update_weight(self, name: str, dtype: Any, shape: Any, empty_cache: bool = False) -> Any:
        if self._ray_group is None:
            return await self.llm.collective_rpc("update_weight", args=(name, dtype, shape, empty_cache))
        from ray.util import collective

        group_name, backend = self._ray_group
        tensor = torch.empty(tuple(shape), dtype=dtype, device="cpu" if backend == "gloo" else self.llm.r3srv.device)
        await asyncio.to_thread(collective.broadcast, tensor, 0, group_name=group_name)
        return await self.llm.collective_rpc("update_weights_from_tensors", args=([(name, tensor)],))

    async def update_weight_cuda_ipc(self, name: str, dtype: Any, shape: Any, ipc_handles: Any,
                                     empty_cache: bool = False) -> Any:
        return await self.llm.collective_rpc("update_weight_cuda_ipc",
                                             args=(name, dtype, shape, ipc_handles, empty_cache))

    # -- cache, pause, memory --------------------------------------------------------------
    async def reset_prefix_cache(self) -> None:
        await self.llm.reset_prefix_cache()

    async def pause_generation(self) -> None:
        await self.llm.pause_generation(mode="keep")

    async def resume_generation(self) -> None:
        await self.llm.resume_generation()

    async def sleep(self, level: int = 1) -> None:
        await self.llm.sleep(level=level)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        for tag in tags or ["weights", "kv_cache"]:  # one tag at a time, as OpenRLHF's actor wakes them
            await self.llm.wake_up(tags=[tag])

    async def is_sleeping(self) -> bool:
        return await self.llm.is_sleeping()

    def shutdown(self) -> None:
        self.llm.shutdown()


def openrlhf_params(params: Any) -> vllm.SamplingParams:
    """A copy of the SamplingParams OpenRLHF sent, as r3srv.compat.vllm's: its own class (where
    OpenRLHF imported vLLM's names from r3srv.compat.vllm) or vLLM's (a msgspec Struct: every
    public field read by name; one r3srv does not know is refused unless unset)."""
    if isinstance(params, vllm.SamplingParams):
        return deepcopy(params)
    if not isinstance(params, msgspec.Struct):
        raise InvalidRequestError(f"sampling_params must be vLLM's SamplingParams, got {type(params).__name__}",
                                  param="sampling_params")
    known = set(vllm.SamplingParams.__struct_fields__)
    values: dict[str, Any] = {}
    for name in type(params).__struct_fields__:
        value = getattr(params, name)
        if name.startswith("_"):
            continue
        if name in known:
            values[name] = int(value) if name == "output_kind" else deepcopy(value)
        elif value not in (None, False, 0, [], {}, ()):
            raise InvalidRequestError(param=f"sampling_params.{name}", problem=f"={value!r} is not served by r3srv")
    return vllm.SamplingParams(**values)


def load_agent_executor(path: str, base: type) -> Any:
    """OpenRLHF's --train.agent_func_path: a Python file defining `AgentExecutor`, a subclass of
    its AgentExecutorBase (checked as OpenRLHF's actor checks it)."""
    if not path.endswith(".py"):
        raise ConfigError(f"agent_func_path={path!r} must be a Python file")
    spec = importlib.util.spec_from_file_location("agent_module", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    executor = getattr(module, "AgentExecutor", None)
    if not (isinstance(executor, type) and issubclass(executor, base)):
        raise ConfigError(f"{path} must define AgentExecutor, a subclass of openrlhf.utils.agent.AgentExecutorBase")
    return executor()
