"""One r3srv engine as verl's rollout server: the Ray actor a replica launches.

It answers what verl's agent loop (LLMServerClient.generate), its replica (sleep, wake_up,
abort_all_requests, resume_generation, clear_kv_cache, ...) and its worker-side adapter
(collective_rpc, set_global_steps) call on vLLM's server actor, with vLLM's semantics, over
r3srv's engine through r3srv.compat.vllm; it also serves r3srv's HTTP routes at the address
verl hands to OpenAI-style clients. Rows (routed experts) come back per token of prompt and
response but the last, as vLLM's, when `rollout.enable_rollout_routing_replay` is on.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import ray
from verl.workers.rollout.replica import RolloutMode, TokenOutput

import r3srv.compat.vllm as vllm
from r3srv import settings
from r3srv.net import bound_socket

logger = logging.getLogger(__name__)

ENGINE_KWARGS_KEY = "r3srv"  # rollout.engine_kwargs.r3srv: any r3srv engine option


class R3srvRolloutServer:
    """vLLM's vLLMHttpServer contract (verl/workers/rollout/vllm_rollout/vllm_async_server.py)."""

    def __init__(self, config, model_config, rollout_mode: RolloutMode, workers: list, replica_rank: int,
                 node_rank: int, gpus_per_node: int, nnodes: int, cuda_visible_devices: str) -> None:
        if cuda_visible_devices:
            settings.restrict_cuda_devices(cuda_visible_devices)
        from verl.utils.config import omega_conf_to_dataclass
        from verl.workers.config import HFModelConfig

        self.config = omega_conf_to_dataclass(config)  # as vLLM's server: RolloutConfig, HFModelConfig
        self.model_config = omega_conf_to_dataclass(model_config, dataclass_type=HFModelConfig)
        self.rollout_mode = rollout_mode
        self.workers = workers
        self.replica_rank = replica_rank
        self.node_rank = node_rank
        self.gpu = bool(cuda_visible_devices)
        self.global_steps = None
        self.engine: vllm.AsyncLLM | None = None
        self._rejecting = False  # abort_all_requests(reject_request=True) until resume_generation
        self._address = ray.util.get_node_ip_address().strip("[]")
        self._port: int | None = None
        self._http: asyncio.Task | None = None

    # -- start-up -------------------------------------------------------------------------
    def engine_options(self) -> dict[str, Any]:
        """verl's rollout config as r3srv engine options (vLLM's keywords where verl passes vLLM's)."""
        c = self.config
        options = dict(
            dtype=c.dtype, max_model_len=c.max_model_len, max_num_seqs=c.max_num_seqs,
            max_num_batched_tokens=c.max_num_batched_tokens, enable_prefix_caching=c.enable_prefix_caching,
            tensor_parallel_size=c.tensor_model_parallel_size,
            enable_expert_parallel=c.expert_parallel_size > 1,
            enable_return_routed_experts=bool(c.enable_rollout_routing_replay),
            seed=c.seed if c.get("seed", None) is not None else 0,
            logprobs_mode=c.get("logprobs_mode", None),  # verl's default is processed_logprobs, as vLLM is given
            device="cuda" if self.gpu else "cpu",
        )
        extra = (c.get("engine_kwargs", {}) or {}).get(ENGINE_KWARGS_KEY, {}) or {}
        options.update({k: v for k, v in extra.items() if v is not None})
        return {k: v for k, v in options.items() if v is not None}

    async def launch_server(self, master_address: str | None = None, master_port: int | None = None,
                            dp_rpc_port: int | None = None) -> None:
        options = self.engine_options()
        self.engine = vllm.AsyncLLM(self.model_config.local_path, **options)
        self._socket = bound_socket(self._address, 0)  # held until the server listens on it
        self._port = self._socket.getsockname()[1]
        self._http = asyncio.create_task(self._serve_http())

    async def _serve_http(self) -> None:
        import uvicorn

        from r3srv.server.app import build_asgi_app

        app = build_asgi_app(self.engine.r3srv, served_model_name=self.model_config.local_path)
        server = uvicorn.Server(uvicorn.Config(app, host=self._address, port=self._port, log_level="warning",
                                               lifespan="off"))
        await server.serve(sockets=[self._socket])

    def get_master_address(self):
        return self._address, None, None

    def get_server_address(self) -> tuple[str, int]:
        assert self._port is not None, "launch_server first"
        return self._address, self._port

    def get_rollout_config(self):
        return self.config

    # -- generation -----------------------------------------------------------------------
    async def generate(self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str,
                       image_data: Any = None, video_data: Any = None, audio_data: Any = None,
                       mm_processor_kwargs: Any = None, priority: int = 0, **unused: Any) -> TokenOutput:
        """Token in, token out, as vLLM's server: max_tokens from the request or the configured
        lengths, logprobs of the sampled tokens when asked, rows when routing replay is on.
        `priority` orders nothing here (r3srv schedules first come, first served)."""
        if any(x is not None for x in (image_data, video_data, audio_data)) or mm_processor_kwargs:
            raise ValueError("multimodal inputs are not supported by r3srv (text and token ids only)")
        extra = {"global_steps": self.global_steps}
        if self._rejecting:
            return TokenOutput(token_ids=[], stop_reason="aborted", extra_fields=extra)
        params = self._sampling_params(list(prompt_ids), dict(sampling_params))
        final = None
        async for out in self.engine.generate(vllm.TokensPrompt(prompt_token_ids=list(prompt_ids)), params,
                                              request_id):
            final = out
        sample = final.outputs[0]
        extra["num_cached_tokens"] = final.num_cached_tokens
        log_probs = None
        if params.logprobs is not None:
            log_probs = [entry[t].logprob for entry, t in zip(sample.logprobs, sample.token_ids)]
        reason = sample.finish_reason
        return TokenOutput(
            token_ids=list(sample.token_ids),
            log_probs=log_probs,
            routed_experts=sample.routed_experts if self.config.enable_rollout_routing_replay else None,
            stop_reason="aborted" if reason == "abort" else "completed" if reason in ("stop", "length") else reason,
            num_preempted=sample.num_preempted,
            extra_fields=extra,
        )

    def _sampling_params(self, prompt_ids: list[int], params: dict[str, Any]) -> vllm.SamplingParams:
        c = self.config
        max_model_len = self.engine.model_config.max_model_len
        room = max_model_len - len(prompt_ids)
        if room < 1:
            raise ValueError(f"prompt length ({len(prompt_ids)}) leaves no room to generate within "
                             f"max_model_len {max_model_len}")
        max_tokens = params.pop("max_tokens", params.pop("max_new_tokens", None))
        if max_tokens is None:
            max_tokens = min(c.response_length, c.prompt_length + c.response_length - len(prompt_ids))
        params["logprobs"] = 0 if params.pop("logprobs", False) else None
        params.setdefault("repetition_penalty", c.get("repetition_penalty", 1.0))
        params.setdefault("ignore_eos", c.get("ignore_eos", False))
        return vllm.SamplingParams(max_tokens=max(1, min(max_tokens, room)),
                                   output_kind=vllm.RequestOutputKind.FINAL_ONLY, **params)

    # -- partial rollout ------------------------------------------------------------------
    async def abort_all_requests(self, reset_prefix_cache: bool = True, reject_request: bool = False) -> dict:
        """Abort what is in flight and pause (requests that arrive wait for resume_generation, or
        with reject_request come back aborted at once)."""
        self._rejecting = reject_request
        in_flight = self.engine.get_num_unfinished_requests()
        await self.engine.pause_generation(mode="abort", clear_cache=reset_prefix_cache)
        return {"aborted_count": in_flight, "request_ids": []}

    async def abort_request(self, request_id: str, reset_prefix_cache: bool = True) -> dict:
        known = await self.engine.r3srv.abort(request_id)
        if known and reset_prefix_cache:
            await self.engine.reset_prefix_cache()
        return {"aborted": known, "request_id": request_id}

    async def resume_generation(self) -> None:
        self._rejecting = False
        await self.engine.resume_generation()

    async def resume_engine_generation(self) -> None:
        await self.engine.resume_generation()

    async def open_submission_gate(self) -> None:
        self._rejecting = False

    async def wait_for_requests_to_drain(self) -> None:
        await self.engine.wait_for_requests_to_drain()

    # -- memory ----------------------------------------------------------------------------
    async def sleep(self) -> None:
        """verl's rule: a hybrid or colocated replica releases its KV cache and weights (r3srv
        keeps the weights in host memory), a standalone one keeps them."""
        if self.rollout_mode is RolloutMode.STANDALONE or not self.config.free_cache_engine:
            return
        await self.engine.sleep(level=1)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        if self.rollout_mode is RolloutMode.STANDALONE:
            return
        await self.engine.wake_up(tags or ["weights", "kv_cache"])
        await self.engine.reset_prefix_cache()

    async def release_kv_cache(self) -> None:
        if self.rollout_mode is RolloutMode.HYBRID and self.config.free_cache_engine:
            await self.engine.pause_generation(mode="wait")
            await self.engine.r3srv.release_memory(["kv_cache"])

    async def resume_kv_cache(self) -> None:
        if self.rollout_mode is RolloutMode.HYBRID and self.config.free_cache_engine:
            await self.engine.wake_up(["kv_cache"])

    async def clear_kv_cache(self) -> None:
        await self.engine.reset_prefix_cache()

    async def is_sleeping(self) -> bool:
        return await self.engine.is_sleeping()

    # -- weights ---------------------------------------------------------------------------
    async def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = (),
                             kwargs: dict | None = None) -> list:
        """r3srv's fixed method table (r3srv.engine.rpc), never a worker extension's method."""
        return await self.engine.collective_rpc(method, timeout=timeout, args=args, kwargs=kwargs)

    async def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = global_steps

    # -- profiling: not offered -------------------------------------------------------------
    async def start_profile(self, **kwargs: Any) -> None:
        logger.info("r3srv's rollout server has no profiler hook; start_profile ignored")

    async def stop_profile(self) -> None:
        pass
