"""vLLM's engine arguments onto r3srv's engine options.

Code written for vLLM builds `LLM(model, **kwargs)`, `EngineArgs(...)` /
`AsyncEngineArgs(...)` or a config from them. Each keyword is one of:

- an r3srv engine option of the same name (r3srv.config: max_model_len, tensor_parallel_size,
  enable_prefix_caching, seed, ...), taken as it is;
- a vLLM setting with nothing to do on r3srv (memory budgets, executors, logging, remote code:
  r3srv loads only its own model families), taken and dropped (WITHOUT_EFFECT);
- a vLLM feature r3srv lacks, taken only at its off value (AT_OFF), else a ConfigError naming it;
- anything else: a ConfigError naming it.

The defaults are vLLM's where they differ from r3srv's library: the device is "auto" (the GPU
when there is one) and routed experts come back only with enable_return_routed_experts=True.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from r3srv.engine_options import options
from r3srv.errors import ConfigError

logger = logging.getLogger(__name__)

VLLM_DEFAULTS = {"device": "auto", "enable_return_routed_experts": False}

WITHOUT_EFFECT: dict[str, str] = {
    "gpu_memory_utilization": "r3srv sizes its KV cache by kv_cache_memory_fraction or num_kv_blocks",
    "swap_space": "r3srv preempts by recompute",
    "trust_remote_code": "r3srv runs its own model families, never a checkpoint's code",
    "distributed_executor_backend": "r3srv's tensor-parallel ranks are its own worker processes",
    "worker_extension_cls": "collective_rpc answers r3srv's fixed method table only (r3srv.engine.rpc)",
    "enable_sleep_mode": "r3srv can always release and resume its memory",
    "disable_log_stats": "logging", "enable_log_requests": "logging", "disable_log_requests": "logging",
    "enable_chunked_prefill": "r3srv always chunks prefills to max_num_batched_tokens",
    "disable_custom_all_reduce": "r3srv's ranks all-reduce through torch.distributed",
    "compilation_config": "r3srv compiles nothing per model (cuda_graphs is its own option)",
    "load_format": "r3srv loads the checkpoint's safetensors (trainers then push their weights)",
    "tokenizer_mode": "r3srv reads tokenizer.json with the tokenizers library",
    "served_model_name": "a name for the HTTP server's routes",
    "max_num_batched_tokens_per_lora": "LoRA is off",
    "bundle_indices": "Ray placement",
    "skip_tokenizer_init": "r3srv's outputs carry token ids either way",
    "hf_overrides": "no-op when empty",
    "model_impl": "r3srv has one implementation per family",
}

# vLLM features r3srv lacks: taken at these values only (the feature off).
AT_OFF: dict[str, tuple[Any, ...]] = {
    "quantization": (None,),
    "kv_cache_dtype": ("auto",),
    "cpu_offload_gb": (0,),
    "enable_lora": (False,),
    "max_loras": (1,),
    "max_lora_rank": (16,),
    "speculative_config": (None,),
    "revision": (None, "main"),
    "tokenizer_revision": (None, "main"),
    "pipeline_parallel_size": (1,),
}


def engine_options(model: str | None, kwargs: dict[str, Any]) -> dict[str, Any]:
    """vLLM's engine keywords as r3srv's engine options (with vLLM's defaults); a ConfigError
    names the first keyword r3srv cannot take."""
    known = {opt.name for opt in options()}
    out: dict[str, Any] = dict(VLLM_DEFAULTS)
    tokenizer = kwargs.get("tokenizer")
    if tokenizer not in (None, model):
        raise ConfigError(f"tokenizer={tokenizer!r}: r3srv reads the tokenizer from the model directory {model!r}")
    for name, value in kwargs.items():
        if name == "tokenizer":
            continue
        if name in known:
            out[name] = value
        elif name in WITHOUT_EFFECT:
            logger.debug("vLLM engine argument %s=%r has no effect on r3srv: %s", name, value, WITHOUT_EFFECT[name])
        elif name in AT_OFF:
            if value not in AT_OFF[name]:
                raise ConfigError(f"{name}={value!r} is not supported by r3srv (only {AT_OFF[name][0]!r})")
        else:
            raise ConfigError(f"{name}={value!r}: not an engine argument r3srv takes (r3srv.compat.vllm.engine_args)")
    if model is not None:
        out["model"] = model
    return out


@dataclass(frozen=True)
class ModelConfig:
    """What vLLM code reads of `llm_engine.model_config` / `AsyncLLM.model_config`."""

    model: str | None
    max_model_len: int
    dtype: Any
    hf_config: Any  # r3srv's parsed model config (its families' shared shape)

    @property
    def tokenizer(self) -> str | None:
        return self.model


class EngineArgs:
    """vLLM's EngineArgs: the keywords, checked when the engine is built from them."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.model = model
        self.kwargs = kwargs
        engine_options(model, kwargs)  # a bad keyword fails here, as vLLM's dataclass would

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["kwargs"][name]
        except KeyError:
            raise AttributeError(name) from None

    def create_engine_config(self, usage_context: Any = None) -> VllmConfig:
        return VllmConfig(engine_options(self.model, self.kwargs))


class AsyncEngineArgs(EngineArgs):
    """vLLM's AsyncEngineArgs (the same keywords)."""


@dataclass(frozen=True)
class VllmConfig:
    """The config `AsyncLLM.from_vllm_config` takes: r3srv's engine options."""

    options: dict[str, Any]
