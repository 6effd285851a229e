"""vLLM's `AsyncLLM` over r3srv's: vLLM's construction (from_engine_args, from_vllm_config),
generate arguments, pause/resume, sleep/wake, drain and collective_rpc, on r3srv's engine and
outputs (one engine, one RequestOutput type)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from typing import Any

from r3srv.compat.vllm.common import check_priority, model_config_of
from r3srv.compat.vllm.engine_args import EngineArgs, ModelConfig, VllmConfig, engine_options
from r3srv.compat.vllm.lora import LoraIds
from r3srv.compat.vllm.outputs import vllm_output
from r3srv.compat.vllm.prompts import read_prompt
from r3srv.compat.vllm.sampling import RequestOutputKind
from r3srv.engine import rpc, sleep
from r3srv.engine.async_llm import AsyncLLM as R3srvAsyncLLM
from r3srv.engine.weight_sync import TrainerUpdates
from r3srv.errors import InvalidRequestError
from r3srv.outputs import OutputKind, RequestOutput
from r3srv.sampling_params import SamplingParams

TRAINER_TIMEOUT_S = 600.0  # how long a rendezvous or a broadcast waits for the trainer


class AsyncLLM:
    """vLLM's AsyncLLM: `AsyncLLM.from_engine_args(AsyncEngineArgs(model, ...))`; `.r3srv` is
    r3srv's AsyncLLM underneath (its own control methods, the HTTP server's engine)."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self._attach(R3srvAsyncLLM(**engine_options(model, kwargs)))

    def _attach(self, engine: R3srvAsyncLLM) -> None:
        self.r3srv = engine
        self._updates: TrainerUpdates | None = None
        self._loras = LoraIds()
        self._lora_lock = asyncio.Lock()  # a first use loads once, however many requests name it at once

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, **_context: Any) -> AsyncLLM:
        """usage_context, stat loggers and the like are vLLM's bookkeeping: ignored."""
        return cls(engine_args.model, **engine_args.kwargs)

    @classmethod
    def from_vllm_config(cls, vllm_config: VllmConfig, **_context: Any) -> AsyncLLM:
        llm = cls.__new__(cls)
        llm._attach(R3srvAsyncLLM(**vllm_config.options))
        return llm

    # -- facts ----------------------------------------------------------------------------
    @property
    def model_config(self) -> ModelConfig:
        return model_config_of(self.r3srv)

    @property
    def tokenizer(self):
        return self.r3srv.tokenizer

    def get_tokenizer(self):
        return self.r3srv.tokenizer

    @property
    def is_running(self) -> bool:
        return self.r3srv.is_running

    @property
    def errored(self) -> bool:
        return not self.r3srv.is_running

    async def check_health(self) -> None:
        if not self.r3srv.is_running:
            raise RuntimeError(f"the engine is not running ({self.r3srv.state.value})")

    def get_num_unfinished_requests(self) -> int:
        return self.r3srv.num_unfinished_requests

    async def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    # -- requests -------------------------------------------------------------------------
    async def generate(self, prompt: Any, sampling_params: SamplingParams | None, request_id: str, *,
                       lora_request: Any = None, priority: int = 0, tokenization_kwargs: dict | None = None,
                       **_request_metadata: Any) -> AsyncIterator[RequestOutput]:
        """One request's outputs, as vLLM's: cumulative unless the params' output_kind says
        otherwise (DELTA, FINAL_ONLY). Leaving the iteration early aborts the request."""
        check_priority(priority)
        lora_name = await self._lora_name(lora_request)
        text_or_ids, params = read_prompt(prompt, sampling_params)
        params = params or SamplingParams()
        kind = getattr(params, "output_kind", RequestOutputKind.CUMULATIVE)
        output_kind = RequestOutputKind(kind).r3srv if not isinstance(kind, OutputKind) else kind
        add_special_tokens = (tokenization_kwargs or {}).get("add_special_tokens", True)
        async for out in self.r3srv.generate(text_or_ids, params, request_id, add_special_tokens=add_special_tokens,
                                             output_kind=output_kind, lora_name=lora_name):
            yield vllm_output(out)

    async def abort(self, request_id: str | Iterable[str], internal: bool = False) -> None:
        for rid in [request_id] if isinstance(request_id, str) else list(request_id):
            await self.r3srv.abort(rid)

    # -- pause, sleep -------------------------------------------------------------------------
    async def pause_generation(self, *, mode: str = "abort", clear_cache: bool = True,
                               wait_for_inflight_requests: bool | None = None) -> None:
        """vLLM's modes: abort, wait (for the requests in flight), keep (frozen in place; a weight
        update then recomputes them on the new weights). wait_for_inflight_requests is the
        older vLLM spelling of mode="wait"."""
        if wait_for_inflight_requests is not None:
            mode = "wait" if wait_for_inflight_requests else "abort"
        if mode not in sleep.SLEEP_MODES:
            raise InvalidRequestError(f"mode must be one of {', '.join(sleep.SLEEP_MODES)}, got {mode!r}", param="mode")
        await self.r3srv.pause_generation(mode)
        if clear_cache:
            await self.r3srv.reset_prefix_cache()

    async def resume_generation(self) -> None:
        await self.r3srv.continue_generation()

    async def is_paused(self) -> bool:
        return self.r3srv.paused is not None

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """vLLM's sleep on r3srv's (engine/sleep.py, the HTTP /sleep's): pause in `mode`; level 1
        and 2 also empty the prefix cache and release the KV cache and the weights."""
        await sleep.sleep(self.r3srv, level, mode)

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        """Take back `tags` (None: all); generation resumes once nothing is released."""
        return await sleep.wake_up(self.r3srv, tags)

    async def is_sleeping(self) -> bool:
        return sleep.is_sleeping(self.r3srv)

    async def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        await self.r3srv.reset_prefix_cache()
        return True

    async def reset_mm_cache(self) -> None:
        """No multimodal inputs, no cache of them."""

    async def wait_for_requests_to_drain(self, drain_timeout: float = 300) -> None:
        """Until no request is in flight; TimeoutError after drain_timeout seconds."""
        await asyncio.wait_for(self.r3srv.requests_drained(), drain_timeout)

    # -- LoRA: vLLM's ids over r3srv's named adapters (needs enable_lora) ---------------------
    async def list_loras(self) -> set[int]:
        """The ids of the adapters loaded through this object (add_lora or a request's lora_request)."""
        return set(self._loras.names)

    async def add_lora(self, lora_request: Any) -> bool:
        """Load the adapter (again, with load_inplace) from its path."""
        await self._lora_name(lora_request)
        return True

    async def remove_lora(self, lora_id: int) -> bool:
        name = self._loras.remove(lora_id)
        if name is not None:
            await self.r3srv.unload_lora_adapter(name)
        return name is not None

    async def _lora_name(self, lora_request: Any) -> str | None:
        if lora_request is None:
            return None
        async with self._lora_lock:
            name, path = self._loras.to_load(lora_request)
            if path is not None:
                await self.r3srv.load_lora_adapter(name, path)
                self._loras.loaded(lora_request)
        return name

    # -- weights ------------------------------------------------------------------------------
    async def collective_rpc(self, method: Any, timeout: float | None = None, args: tuple = (),
                             kwargs: dict | None = None) -> list[Any]:
        """A weight-sync method of r3srv's fixed table (r3srv.engine.rpc), by name; `timeout`
        bounds the wait, as vLLM's."""
        call = rpc.collective_rpc(self.trainer_updates(), method, args, kwargs)
        return await (call if timeout is None else asyncio.wait_for(call, timeout))

    def trainer_updates(self) -> TrainerUpdates:
        if self._updates is None:
            self._updates = TrainerUpdates(self.r3srv, TRAINER_TIMEOUT_S)
        return self._updates

    def shutdown(self, timeout: float | None = None) -> None:
        self.r3srv.shutdown()
