"""What vLLM's LLM and AsyncLLM share in r3srv.compat.vllm: refusals of the arguments r3srv
does not serve, sleep levels and the model config view."""

from __future__ import annotations

from typing import Any

from r3srv.compat.vllm.engine_args import ModelConfig
from r3srv.errors import InvalidRequestError

SLEEP_LEVELS = (0, 1, 2)
WAKE_TAGS = ("weights", "kv_cache", "scheduling")
MEMORY_TAGS = ["kv_cache", "weights"]


def check_request_extras(lora_request: Any = None, priority: int | None = 0) -> None:
    """vLLM's generate arguments r3srv takes only when off: no LoRA adapter, no priority."""
    if lora_request is not None:
        raise InvalidRequestError("LoRA adapters are not supported by r3srv: pass lora_request=None",
                                  param="lora_request")
    if priority not in (None, 0):
        raise InvalidRequestError(f"priority={priority!r}: priority scheduling is not supported by r3srv (only 0)",
                                  param="priority")


def check_sleep_level(level: int) -> None:
    if level not in SLEEP_LEVELS:
        raise InvalidRequestError(f"level must be 0, 1 or 2, got {level!r}", param="level")


def memory_tags(tags: list[str] | None) -> list[str] | None:
    """The memory tags of a wake_up (None: all); "scheduling" only resumes stepping."""
    unknown = sorted(set(tags or ()) - set(WAKE_TAGS))
    if unknown:
        raise InvalidRequestError(f"tags: {unknown} unknown; known: {', '.join(WAKE_TAGS)}", param="tags")
    return None if tags is None else [t for t in tags if t != "scheduling"]


def model_config_of(engine) -> ModelConfig:
    """vLLM's model_config view of an r3srv engine (LLMEngine or AsyncLLM)."""
    return ModelConfig(model=engine.model_path, max_model_len=engine.max_model_len, dtype=engine.dtype,
                       hf_config=engine.model_config)
