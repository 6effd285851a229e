"""What vLLM's LLM and AsyncLLM share in r3srv.compat.vllm: the refusal of priorities and the
model config view."""

from __future__ import annotations

from r3srv.compat.vllm.engine_args import ModelConfig
from r3srv.errors import InvalidRequestError


def check_priority(priority: int | None = 0) -> None:
    """vLLM's priority, which r3srv takes only when off."""
    if priority not in (None, 0):
        raise InvalidRequestError(f"priority={priority!r}: priority scheduling is not supported by r3srv (only 0)",
                                  param="priority")


def model_config_of(engine) -> ModelConfig:
    """vLLM's model_config view of an r3srv engine (LLMEngine or AsyncLLM)."""
    return ModelConfig(model=engine.model_path, max_model_len=engine.max_model_len, dtype=engine.dtype,
                       hf_config=engine.model_config)
