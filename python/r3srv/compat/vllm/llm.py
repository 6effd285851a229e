"""vLLM's offline `LLM` over r3srv's: vLLM's constructor keywords, prompt forms, generate
arguments and method names, on r3srv's engine and outputs (RequestOutput is r3srv's, already
vLLM-shaped: Logprob entries, routed_experts, num_preempted; sampling masks in vLLM's form, outputs.py)."""

from __future__ import annotations

import asyncio
from typing import Any

from r3srv.compat.vllm.common import check_priority, model_config_of
from r3srv.compat.vllm.engine_args import ModelConfig, engine_options
from r3srv.compat.vllm.lora import LoraIds
from r3srv.compat.vllm.outputs import vllm_output
from r3srv.compat.vllm.prompts import is_one_prompt, read_prompt
from r3srv.engine import rpc
from r3srv.engine.llm import LLM as R3srvLLM
from r3srv.engine.llm_engine import MEMORY_TAGS
from r3srv.engine.sleep import check_level, memory_tags
from r3srv.errors import InvalidRequestError
from r3srv.outputs import RequestOutput
from r3srv.sampling_params import SamplingParams


class LLMEngineView:
    """What vLLM code reads of `LLM.llm_engine`."""

    def __init__(self, llm: LLM) -> None:
        self._llm = llm

    @property
    def model_config(self) -> ModelConfig:
        return model_config_of(self._llm.r3srv.engine)

    def get_tokenizer(self):
        return self._llm.get_tokenizer()

    def reset_prefix_cache(self) -> bool:
        return self._llm.reset_prefix_cache()

    def collective_rpc(self, method: Any, timeout: float | None = None, args: tuple = (),
                       kwargs: dict | None = None) -> list[Any]:
        return self._llm.collective_rpc(method, timeout, args, kwargs)

    def sleep(self, level: int = 1) -> None:
        self._llm.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self._llm.wake_up(tags)

    def get_num_unfinished_requests(self) -> int:
        return len(self._llm.r3srv.engine.requests)


class LLM:
    """vLLM's LLM: `LLM(model, **vllm_engine_kwargs)` (engine_args.py says which keywords r3srv
    takes); `.r3srv` is the r3srv LLM underneath."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        options = engine_options(model, kwargs)
        self.r3srv = R3srvLLM(**options)
        self._loras = LoraIds()
        self.llm_engine = LLMEngineView(self)

    def get_tokenizer(self):
        return self.r3srv.tokenizer

    def generate(self, prompts: Any, sampling_params: SamplingParams | list[SamplingParams] | None = None, *,
                 use_tqdm: bool = False, lora_request: Any = None, priority: list[int] | int | None = None,
                 tokenization_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Prompts as vLLM takes them (strings, token ids, TextPrompt / TokensPrompt dicts, one
        or a list); outputs in prompt order."""
        for one in priority if isinstance(priority, list) else [priority]:
            check_priority(one)
        add_special_tokens = (tokenization_kwargs or {}).get("add_special_tokens", True)
        prompt_list = [prompts] if is_one_prompt(prompts) else list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise InvalidRequestError(f"got {len(params_list)} sampling_params for {len(prompt_list)} prompts",
                                          param="sampling_params")
        read = [read_prompt(p, sp) for p, sp in zip(prompt_list, params_list)]
        if isinstance(lora_request, list) and len(lora_request) != len(prompt_list):
            raise InvalidRequestError(f"got {len(lora_request)} lora_request for {len(prompt_list)} prompts",
                                      param="lora_request")
        lora_name = ([self._lora_name(r) for r in lora_request] if isinstance(lora_request, list)
                     else self._lora_name(lora_request))
        outs = self.r3srv.generate([p for p, _ in read], [sp or SamplingParams() for _, sp in read],
                                   use_tqdm=use_tqdm, add_special_tokens=add_special_tokens, lora_name=lora_name)
        return [vllm_output(out) for out in outs]

    def chat(self, messages: Any, sampling_params: SamplingParams | list[SamplingParams] | None = None, *,
             use_tqdm: bool = False, lora_request: Any = None, **template_kwargs: Any) -> list[RequestOutput]:
        if template_kwargs.get("chat_template") is not None:
            raise InvalidRequestError("custom chat templates are not supported by r3srv: the model's own is used",
                                      param="chat_template")
        outs = self.r3srv.chat(messages, sampling_params, use_tqdm=use_tqdm, lora_name=self._lora_name(lora_request))
        return [vllm_output(out) for out in outs]

    def _lora_name(self, lora_request: Any) -> str | None:
        """The r3srv adapter a vLLM LoRARequest names, loaded from its path the first time its id is seen."""
        if lora_request is None:
            return None
        name, path = self._loras.to_load(lora_request)
        if path is not None:
            self.r3srv.load_lora_adapter(name, path)
            self._loras.loaded(lora_request)
        return name

    # -- control, vLLM's names ------------------------------------------------------------
    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        self.r3srv.reset_prefix_cache()
        return True

    def sleep(self, level: int = 1) -> None:
        """Level 1 and 2: the prefix cache emptied, the KV cache and weights released (the weights
        kept in host memory at either level, so a wake without a push serves them again)."""
        check_level(level)
        if level >= 1:
            self.r3srv.reset_prefix_cache()
            self.r3srv.release_memory(list(MEMORY_TAGS))

    def wake_up(self, tags: list[str] | None = None) -> None:
        memory = memory_tags(tags)
        if memory is None or memory:
            self.r3srv.resume_memory(memory)

    def is_sleeping(self) -> bool:
        return bool(self.r3srv.engine.released_memory)

    def collective_rpc(self, method: Any, timeout: float | None = None, args: tuple = (),
                       kwargs: dict | None = None) -> list[Any]:
        """A weight-sync method of r3srv's fixed table (r3srv.engine.rpc), by name."""
        return asyncio.run(rpc.collective_rpc(self.r3srv.trainer_updates(), method, args, kwargs))

    def shutdown(self) -> None:
        self.r3srv.shutdown()
